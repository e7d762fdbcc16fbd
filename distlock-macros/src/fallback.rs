//! On error: the user's item unchanged plus the errors, so that the rest of the crate (and the
//! IDE) still sees the function and reports its other problems.

use proc_macro2::TokenStream;
use quote::quote;

pub(crate) fn item_with_errors(item: TokenStream, error: syn::Error) -> TokenStream {
    let errors = error.to_compile_error();
    quote!(#item #errors)
}
