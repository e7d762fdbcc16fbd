//! Which items the attribute accepts: `async fn`s with a body and a return type that can
//! carry a `LockError`.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::{Attribute, Block, FnArg, Pat, ReturnType, Signature, Type, Visibility};

/// An accepted function, in pieces.
pub(crate) struct LockFn {
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) vis: Visibility,
    pub(crate) sig: Signature,
    pub(crate) block: Box<Block>,
}

impl LockFn {
    /// The names bound by the parameters (through patterns too).
    pub(crate) fn param_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for arg in &self.sig.inputs {
            if let FnArg::Typed(typed) = arg {
                collect_names(&typed.pat, &mut names);
            }
        }
        names
    }

    /// Whether the function takes `self` in any form.
    pub(crate) fn has_self(&self) -> bool {
        self.sig.receiver().is_some()
    }

    /// The declared return type.
    pub(crate) fn return_type(&self) -> &Type {
        match &self.sig.output {
            ReturnType::Type(_, ty) => ty,
            ReturnType::Default => unreachable!("checked by `function`"),
        }
    }
}

fn collect_names(pat: &Pat, names: &mut Vec<String>) {
    match pat {
        Pat::Ident(p) => {
            names.push(p.ident.to_string());
            if let Some((_, sub)) = &p.subpat {
                collect_names(sub, names);
            }
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| collect_names(p, names)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| collect_names(p, names)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| collect_names(&f.pat, names)),
        Pat::Reference(r) => collect_names(&r.pat, names),
        Pat::Slice(s) => s.elems.iter().for_each(|p| collect_names(p, names)),
        Pat::Paren(p) => collect_names(&p.pat, names),
        Pat::Type(t) => collect_names(&t.pat, names),
        _ => {}
    }
}

const NEEDS_RESULT: &str = "`#[distributed_lock]` functions must return `Result<_, E>` where \
     `E: From<distlock::LockError>`, so that a lock that was not taken can be reported";

/// Accepts an `async fn` with a body, or explains what is wrong with the item.
pub(crate) fn function(item: TokenStream) -> syn::Result<LockFn> {
    let parsed = match syn::parse2::<syn::ItemFn>(item.clone()) {
        Ok(f) => f,
        Err(fn_error) => return Err(not_a_function(item, fn_error)),
    };
    let syn::ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = parsed;
    if let Some(constness) = &sig.constness {
        return Err(syn::Error::new(
            constness.span(),
            "`#[distributed_lock]` cannot be used on a `const fn`: taking a lock needs Redis at run time",
        ));
    }
    if sig.asyncness.is_none() {
        if returns_boxed_future(&sig.output) {
            return Err(syn::Error::new(
                sig.fn_token.span(),
                "`#[distributed_lock]` sees this method after `#[async_trait]` turned it into a \
                 plain `fn` returning a boxed future; use native `async fn` in the trait \
                 (Rust 1.75+) instead of `#[async_trait]`, or take the lock by hand with \
                 `LockManager::lock` inside the method",
            ));
        }
        return Err(syn::Error::new(
            sig.fn_token.span(),
            "`#[distributed_lock]` requires an `async fn`: the lock is awaited before the body runs",
        ));
    }
    match &sig.output {
        ReturnType::Default => {
            return Err(syn::Error::new(
                sig.paren_token.span.close(),
                format!("{NEEDS_RESULT}: add a return type such as `-> Result<(), MyError>`"),
            ));
        }
        ReturnType::Type(_, ty) if matches!(**ty, Type::ImplTrait(_)) => {
            return Err(syn::Error::new(
                ty.span(),
                format!("{NEEDS_RESULT}, not `impl Trait`"),
            ));
        }
        ReturnType::Type(..) => {}
    }
    Ok(LockFn {
        attrs,
        vis,
        sig,
        block,
    })
}

fn not_a_function(item: TokenStream, fn_error: syn::Error) -> syn::Error {
    if let Ok(method) = syn::parse2::<syn::TraitItemFn>(item.clone())
        && method.default.is_none()
    {
        return syn::Error::new(
            method.sig.span(),
            "`#[distributed_lock]` needs a function body to lock: put it on the method in \
             the `impl` block, not on the trait's declaration",
        );
    }
    match syn::parse2::<syn::Item>(item) {
        Ok(other) => {
            let span = match &other {
                syn::Item::Struct(s) => s.struct_token.span(),
                syn::Item::Enum(e) => e.enum_token.span(),
                syn::Item::Impl(i) => i.impl_token.span(),
                syn::Item::Trait(t) => t.trait_token.span(),
                syn::Item::Mod(m) => m.mod_token.span(),
                other => other
                    .to_token_stream()
                    .into_iter()
                    .next()
                    .map_or_else(proc_macro2::Span::call_site, |t| t.span()),
            };
            syn::Error::new(
                span,
                "`#[distributed_lock]` can only be applied to an `async fn` (a free function or a method)",
            )
        }
        Err(_) => fn_error,
    }
}

/// `-> Pin<Box<dyn Future<…> + …>>`, the shape `#[async_trait]` produces.
fn returns_boxed_future(output: &ReturnType) -> bool {
    match output {
        ReturnType::Type(_, ty) => {
            let text = ty.to_token_stream().to_string();
            text.contains("Pin") && text.contains("Future")
        }
        ReturnType::Default => false,
    }
}
