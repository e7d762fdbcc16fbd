//! Code generation: the function keeps its signature; its body runs between acquire and
//! release, rewritten in place as `async move { … }.await` so that `return` and `?` stay
//! inside it and cannot skip the release.

use proc_macro2::{Literal, Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{AttrStyle, Block, Ident, Type};

use crate::args::{self, Args, Mode, OnBusy, OnLost};
use crate::check::{self, LockFn};
use crate::fallback;

/// The whole attribute: parse, validate, expand, or fall back to the item plus errors.
pub(crate) fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = args::Errors::default();
    let args = args::parse(args, Span::call_site())
        .map_err(|e| errors.push(e))
        .ok();
    let function = check::function(item.clone())
        .map_err(|e| errors.push(e))
        .ok();
    if let (Some(args), Some(function)) = (&args, &function) {
        let (params, has_self) = (function.param_names(), function.has_self());
        for template in args.key.iter().chain(args.keys.iter().flatten()) {
            if let Err(error) = template.check_roots(&params, has_self) {
                errors.push(error);
            }
        }
    }
    match (errors.finish(), args, function) {
        (Ok(()), Some(args), Some(function)) => expand(args, function),
        (Err(error), ..) => fallback::item_with_errors(item, error),
        (Ok(()), ..) => unreachable!("a missing part always comes with an error"),
    }
}

/// The names the expansion introduces, at mixed-site hygiene: the body cannot see them.
struct Names {
    guard: Ident,
    output: Ident,
    manager: Ident,
    error: Ident,
    fake: Ident,
}

impl Names {
    fn new() -> Self {
        let mixed = Span::mixed_site();
        Self {
            guard: Ident::new("__distlock_guard", mixed),
            output: Ident::new("__distlock_output", mixed),
            manager: Ident::new("__distlock_manager", mixed),
            error: Ident::new("__distlock_error", mixed),
            fake: Ident::new("__distlock_return", mixed),
        }
    }
}

/// The function's return type as the expansion uses it.
struct Return {
    /// Where failures are reported: the written return type.
    span: Span,
    /// The return type with every `impl Trait` as `_`, as a `let` can name it.
    erased: Type,
    /// The return of a lock error (`error`) in that type.
    fail: TokenStream,
}

impl Return {
    fn of(function: &LockFn, error: &Ident) -> Self {
        let ret = function.return_type();
        let span = ret.span();
        let erased = erase_impl_trait(ret.clone());
        let fail = quote_spanned! {span=>
            <#erased as ::distlock::__private::LockReturn>::from_lock_error(#error)
        };
        Self { span, erased, fail }
    }
}

/// The function as written, with its body replaced by [`gen_block`]'s.
fn expand(args: Args, function: LockFn) -> TokenStream {
    let names = Names::new();
    let ret = Return::of(&function, &names.error);
    let body = gen_block(&args, &names, &ret, &function.block);
    gen_function(function, body)
}

/// The function's attributes, visibility and signature around `body`; its inner attributes
/// stay first in the body.
fn gen_function(function: LockFn, body: TokenStream) -> TokenStream {
    let LockFn {
        attrs, vis, sig, ..
    } = function;
    let (inner, outer): (Vec<_>, Vec<_>) = attrs
        .into_iter()
        .partition(|attr| matches!(attr.style, AttrStyle::Inner(_)));
    quote! {
        #(#outer)*
        #vis #sig {
            #(#inner)*
            #body
        }
    }
}

/// The new body: take the manager, acquire, run the written body, release, return.
fn gen_block(args: &Args, names: &Names, ret: &Return, block: &Block) -> TokenStream {
    let Names {
        guard,
        output,
        manager,
        error,
        fake,
    } = names;
    let (ret_erased, fail) = (&ret.erased, &ret.fail);
    let get_manager = gen_manager(args, names, fail);
    let (request, guard_type, acquire) = gen_request(args);
    let options = gen_options(args);
    let on_lost = gen_on_lost(args);
    let on_error = gen_on_error(args, names, ret);
    let bind_guard = args
        .guard
        .as_ref()
        .map(|name| quote!(let #name: &#guard_type = &#guard;));
    let stmts = &block.stmts;

    quote! {
        #get_manager
        let #guard = match ::distlock::__private::#acquire(
            #manager.#request #options
        ).await {
            ::core::result::Result::Ok(#guard) => #guard,
            #on_error
        };
        #bind_guard
        let #output = ::distlock::__private::run(&#guard, #on_lost, async move {
            // Gives the block the function's return type, so `?` and `return` inside
            // it convert exactly as they would in the original body.
            #[allow(unreachable_code, clippy::diverging_sub_expression, clippy::empty_loop)]
            if false {
                let #fake: #ret_erased = loop {};
                return #fake;
            }
            #(#stmts)*
        })
        .await;
        let #output = match #output {
            ::core::result::Result::Ok(#output) => #output,
            ::core::result::Result::Err(#error) => return #fail,
        };
        if let ::core::result::Result::Err(#error) =
            ::distlock::__private::release(#guard, #on_lost).await
        {
            return #fail;
        }
        #output
    }
}

/// Binds the manager: the `manager = …` expression, or the installed one.
fn gen_manager(args: &Args, names: &Names, fail: &TokenStream) -> TokenStream {
    let Names { manager, error, .. } = names;
    match &args.manager {
        // Taking `&(expr)` lets `manager = self.locks` name a field without moving it.
        Some(expr) => quote_spanned! {expr.span()=>
            #[allow(clippy::needless_borrows_for_generic_args)]
            let #manager = ::distlock::__private::AsLockManager::lock_manager(&(#expr));
        },
        None => quote! {
            let #manager = match ::distlock::__private::installed() {
                ::core::result::Result::Ok(#manager) => #manager,
                ::core::result::Result::Err(#error) => return #fail,
            };
        },
    }
}

/// One lock, or a set of locks taken together (`keys`): what to request, the guard's type,
/// and the `__private` function that takes that kind of guard.
fn gen_request(args: &Args) -> (TokenStream, TokenStream, TokenStream) {
    match (&args.key, &args.keys) {
        (_, Some(templates)) => {
            let keys = templates.iter().map(|t| {
                let key = t.expr();
                quote_spanned!(t.lit.span()=> ::distlock::__private::set_key(#key))
            });
            let text = templates
                .iter()
                .map(|t| t.lit.value())
                .collect::<Vec<_>>()
                .join(", ");
            (
                quote!(lock_all([#(#keys),*]).template(#text)),
                quote!(::distlock::MultiGuard),
                quote!(acquire_all),
            )
        }
        (Some(template), None) => {
            let key = template.expr();
            let text = template.lit.value();
            let method = match (&args.mode, &args.permits) {
                (Some((lit, Mode::Read)), _) => quote_spanned!(lit.span()=> read_lock),
                (Some((lit, Mode::Write)), _) => quote_spanned!(lit.span()=> write_lock),
                (None, Some((lit, _))) => quote_spanned!(lit.span()=> semaphore),
                (None, None) => quote!(lock),
            };
            let permits = args.permits.as_ref().map(|(lit, n)| {
                let n = Literal::u32_unsuffixed(*n);
                quote_spanned!(lit.span()=> , #n)
            });
            (
                quote!(#method(#key #permits).template(#text)),
                quote!(::distlock::LockGuard),
                quote!(acquire),
            )
        }
        (None, None) => unreachable!("`key` or `keys` is required by `args::parse`"),
    }
}

/// The request's builder calls, one per option given.
fn gen_options(args: &Args) -> TokenStream {
    let mut options = TokenStream::new();
    let millis = |lit: &syn::LitStr, ms: u64| {
        let ms = Literal::u64_unsuffixed(ms);
        quote_spanned!(lit.span()=> ::core::time::Duration::from_millis(#ms))
    };
    if let Some(ttl) = &args.ttl {
        let d = millis(&ttl.lit, ttl.millis);
        options.extend(quote!(.ttl(#d)));
    }
    if let Some((lit, retries)) = &args.retries {
        let n = Literal::u32_unsuffixed(*retries);
        options.extend(quote_spanned!(lit.span()=> .retries(#n)));
    }
    if let Some(delay) = &args.retry_delay {
        let d = millis(&delay.lit, delay.millis);
        options.extend(quote!(.retry_delay(#d)));
    }
    if let Some(wait) = &args.wait {
        let d = millis(&wait.lit, wait.millis);
        options.extend(quote!(.wait(#d)));
    }
    if let Some(flag) = &args.fencing {
        options.extend(quote_spanned!(flag.span()=> .fencing(true)));
    }
    if let Some(flag) = &args.watchdog {
        options.extend(quote_spanned!(flag.span()=> .watchdog(true)));
    }
    if let Some(max_hold) = &args.max_hold {
        let d = millis(&max_hold.lit, max_hold.millis);
        options.extend(quote!(.max_hold(#d)));
    }
    if let Some(flag) = &args.reentrant {
        options.extend(quote_spanned!(flag.span()=> .reentrant(true)));
    }
    if let Some(flag) = &args.fair {
        options.extend(quote_spanned!(flag.span()=> .fair(true)));
    }
    if let Some(min_hold) = &args.min_hold {
        let d = millis(&min_hold.lit, min_hold.millis);
        options.extend(quote!(.min_hold(#d)));
    }
    options
}

/// What a lost lease does to the body. Without a watchdog a lease is expected to cover the
/// body; with one, a lost lease means another owner may be inside, so the body is stopped
/// unless told otherwise.
fn gen_on_lost(args: &Args) -> TokenStream {
    let on_lost = match args.on_lost.as_ref().map(|(_, v)| *v) {
        Some(OnLost::Abort) => quote!(Abort),
        Some(OnLost::Error) => quote!(Error),
        Some(OnLost::Continue) => quote!(Continue),
        None if args.watchdog.is_some() => quote!(Abort),
        None => quote!(Continue),
    };
    quote!(::distlock::__private::OnLost::#on_lost)
}

/// The match arms for a failed acquire: skip the body when busy (`on_busy = "skip"`), or
/// return the error.
fn gen_on_error(args: &Args, names: &Names, ret: &Return) -> TokenStream {
    let error = &names.error;
    let (ret_span, ret_erased, fail) = (ret.span, &ret.erased, &ret.fail);
    match &args.on_busy {
        Some((_, OnBusy::Skip)) => quote_spanned! {ret_span=>
            ::core::result::Result::Err(#error) if #error.is_busy() => {
                return <#ret_erased as ::distlock::__private::SkipReturn>::skipped();
            }
            ::core::result::Result::Err(#error) => return #fail,
        },
        Some((_, OnBusy::Error)) | None => quote! {
            ::core::result::Result::Err(#error) => return #fail,
        },
    }
}

/// `impl Trait` cannot be written in a `let`: it becomes `_` there.
fn erase_impl_trait(mut ty: Type) -> Type {
    struct Erase;
    impl VisitMut for Erase {
        fn visit_type_mut(&mut self, ty: &mut Type) {
            if let Type::ImplTrait(it) = ty {
                *ty = Type::Infer(syn::TypeInfer {
                    underscore_token: syn::Token![_](it.span()),
                });
            } else {
                syn::visit_mut::visit_type_mut(self, ty);
            }
        }
    }
    Erase.visit_type_mut(&mut ty);
    ty
}
