//! Parsing `#[distributed_lock(...)]` arguments, keeping literals for their spans.

use proc_macro2::{Span, TokenStream};
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitInt, LitStr};

use crate::duration::{self, DurationArg};
use crate::key::{self, Template};

const KNOWN: &str = "`key`, `keys`, `ttl`, `retries`, `retry_delay`, `wait`, `watchdog`, `max_hold`, \
     `reentrant`, `fencing`, `fair`, `mode`, `permits`, `on_busy`, `on_lost`, `min_hold`, `guard`, \
     `manager`";

/// What to do when the lock is held by someone else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnBusy {
    Error,
    Skip,
}

/// What to do when the lease is lost while the body runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnLost {
    Abort,
    Error,
    Continue,
}

/// The side of a read-write lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Read,
    Write,
}

/// The validated arguments.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Option<Template>,
    /// `keys = [...]`: the templates of a set of locks taken together.
    pub(crate) keys: Option<Vec<Template>>,
    pub(crate) ttl: Option<DurationArg>,
    pub(crate) retries: Option<(LitInt, u32)>,
    pub(crate) retry_delay: Option<DurationArg>,
    pub(crate) wait: Option<DurationArg>,
    pub(crate) fencing: Option<Ident>,
    pub(crate) watchdog: Option<Ident>,
    pub(crate) reentrant: Option<Ident>,
    pub(crate) fair: Option<Ident>,
    pub(crate) max_hold: Option<DurationArg>,
    pub(crate) min_hold: Option<DurationArg>,
    pub(crate) on_lost: Option<(LitStr, OnLost)>,
    pub(crate) mode: Option<(LitStr, Mode)>,
    pub(crate) permits: Option<(LitInt, u32)>,
    pub(crate) on_busy: Option<(LitStr, OnBusy)>,
    pub(crate) guard: Option<Ident>,
    pub(crate) manager: Option<Expr>,
}

/// Collects errors so that one compile reports them all.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub(crate) fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Parses the attribute's tokens. `call_site` is where a missing `key` is reported.
pub(crate) fn parse(tokens: TokenStream, call_site: Span) -> syn::Result<Args> {
    let mut args = Args::default();
    let mut errors = Errors::default();
    let mut key_seen = false;
    let parser = syn::meta::parser(|meta| {
        key_seen |= meta.path.is_ident("key") || meta.path.is_ident("keys");
        if let Err(error) = args.one(&meta) {
            errors.push(error);
        }
        Ok(())
    });
    parser.parse2(tokens)?;
    if !key_seen {
        errors.push(syn::Error::new(
            call_site,
            "missing `key`: name the lock, as in `#[distributed_lock(key = \"order:{order.id}\")]`, \
             or a set of locks, as in `keys = [\"account:{from}\", \"account:{to}\"]`",
        ));
    }
    args.check_conflicts(&mut errors);
    errors.finish()?;
    Ok(args)
}

/// Stores `value` in `slot`, or reports a duplicate at the later argument.
fn set<T>(slot: &mut Option<T>, value: T, meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    if slot.is_some() {
        let name = meta
            .path
            .get_ident()
            .map(ToString::to_string)
            .unwrap_or_default();
        return Err(meta.error(format!("duplicate argument `{name}`: give it once")));
    }
    *slot = Some(value);
    Ok(())
}

impl Args {
    fn one(&mut self, meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
        let Some(name) = meta.path.get_ident().map(ToString::to_string) else {
            return Err(meta.error(format!("unknown argument; expected one of {KNOWN}")));
        };
        match name.as_str() {
            "key" => {
                let template = key::parse(string(meta, "key")?)?;
                if self.keys.is_some() {
                    return Err(meta.error(ONE_OF_KEY_KEYS));
                }
                set(&mut self.key, template, meta)
            }
            "keys" => {
                let templates = templates(meta)?;
                if self.key.is_some() {
                    return Err(meta.error(ONE_OF_KEY_KEYS));
                }
                set(&mut self.keys, templates, meta)
            }
            "ttl" => set(&mut self.ttl, duration_arg(meta, "ttl")?, meta),
            "retry_delay" => set(
                &mut self.retry_delay,
                duration_arg(meta, "retry_delay")?,
                meta,
            ),
            "wait" => set(&mut self.wait, duration_arg(meta, "wait")?, meta),
            "retries" => set(
                &mut self.retries,
                whole_number(meta, "retries", 3, 0)?,
                meta,
            ),
            "fencing" => set(&mut self.fencing, flag(meta, "fencing")?, meta),
            "watchdog" => set(&mut self.watchdog, flag(meta, "watchdog")?, meta),
            "reentrant" => set(&mut self.reentrant, flag(meta, "reentrant")?, meta),
            "fair" => set(&mut self.fair, flag(meta, "fair")?, meta),
            "max_hold" => set(&mut self.max_hold, duration_arg(meta, "max_hold")?, meta),
            "min_hold" => set(&mut self.min_hold, duration_arg(meta, "min_hold")?, meta),
            "on_lost" => {
                let choices = [
                    ("abort", OnLost::Abort),
                    ("error", OnLost::Error),
                    ("continue", OnLost::Continue),
                ];
                let on_lost = choice(meta, "on_lost", "`on_lost` value", &choices)?;
                set(&mut self.on_lost, on_lost, meta)
            }
            "on_busy" => {
                let choices = [("error", OnBusy::Error), ("skip", OnBusy::Skip)];
                let on_busy = choice(meta, "on_busy", "`on_busy` value", &choices)?;
                set(&mut self.on_busy, on_busy, meta)
            }
            "guard" => {
                let ident: Ident = value(
                    meta,
                    "guard",
                    "a name to bind the guard to, as in `guard = lock`",
                )?;
                set(&mut self.guard, ident, meta)
            }
            "manager" => {
                let expr: Expr = meta.value()?.parse()?;
                set(&mut self.manager, expr, meta)
            }
            "mode" => {
                let choices = [("read", Mode::Read), ("write", Mode::Write)];
                set(
                    &mut self.mode,
                    choice(meta, "mode", "`mode`", &choices)?,
                    meta,
                )
            }
            "permits" => set(
                &mut self.permits,
                whole_number(meta, "permits", 4, 1)?,
                meta,
            ),
            _ => Err(unknown(meta, &name)),
        }
    }

    /// Options that cannot all be meant: reported at the later one.
    fn check_conflicts(&self, errors: &mut Errors) {
        self.check_set(errors);
        self.check_kind(errors);
        self.check_timing(errors);
    }

    /// A set is a set of exclusive locks: the options of other kinds are reported on
    /// themselves, wherever they stand.
    fn check_set(&self, errors: &mut Errors) {
        if self.keys.is_none() {
            return;
        }
        if let Some((mode, _)) = &self.mode {
            errors.push(syn::Error::new(
                mode.span(),
                "`mode` cannot be combined with `keys`: a set of locks is taken exclusively; \
                 remove `mode`, or lock each key on its own",
            ));
        }
        if let Some((permits, _)) = &self.permits {
            errors.push(syn::Error::new(
                permits.span(),
                "`permits` cannot be combined with `keys`: a set of locks is taken exclusively; \
                 remove `permits`, or take each semaphore on its own",
            ));
        }
        if let Some(min_hold) = &self.min_hold {
            errors.push(syn::Error::new(
                min_hold.lit.span(),
                "`min_hold` cannot be combined with `keys`: it applies to single locks; \
                 remove `min_hold`, or use `key`",
            ));
        }
    }

    /// The kind of lock: a semaphore, a read-write lock, a fair lock, and what each allows.
    fn check_kind(&self, errors: &mut Errors) {
        if let (Some(_), Some((permits, _))) = (&self.mode, &self.permits) {
            errors.push(syn::Error::new(
                permits.span(),
                "`permits` makes a semaphore and `mode` a read-write lock: use one of them",
            ));
        }
        if let (Some(reentrant), Some(_)) = (&self.reentrant, &self.permits) {
            errors.push(syn::Error::new(
                reentrant.span(),
                "semaphore permits are not reentrant: every call takes its own permit; remove `reentrant`",
            ));
        }
        if let (Some(fair), Some(other)) = (&self.fair, self.unfair()) {
            errors.push(syn::Error::new(
                fair.span(),
                format!("`fair` cannot be combined with {other}; remove one of them"),
            ));
        }
        let shared = matches!(self.mode, Some((_, Mode::Read))) || self.permits.is_some();
        if let (Some(min_hold), true) = (&self.min_hold, shared) {
            errors.push(syn::Error::new(
                min_hold.lit.span(),
                "`min_hold` applies to exclusive and write locks, not to read locks or permits",
            ));
        }
    }

    /// The first option given that a fair lock cannot have, and why.
    fn unfair(&self) -> Option<&'static str> {
        if self.keys.is_some() {
            Some("`keys`: a set of locks is taken all at once, not in a queue")
        } else if self.mode.is_some() {
            Some("`mode`: fair locks are exclusive")
        } else if self.permits.is_some() {
            Some("`permits`: fair locks are exclusive")
        } else if self.fencing.is_some() {
            Some("`fencing`: fair locks do not draw fencing tokens")
        } else if self.min_hold.is_some() {
            Some("`min_hold`: a fair lock goes to the next waiter when released")
        } else {
            None
        }
    }

    /// Durations and retries that have no effect, or defeat each other.
    fn check_timing(&self, errors: &mut Errors) {
        if let (Some(max_hold), None) = (&self.max_hold, &self.watchdog) {
            errors.push(syn::Error::new(
                max_hold.lit.span(),
                "`max_hold` bounds watchdog renewal and has no effect without `watchdog`: \
                 add `watchdog`, or use `ttl` to bound the lease",
            ));
        }
        if let (Some(ttl), Some(min_hold)) = (&self.ttl, &self.min_hold)
            && min_hold.millis > ttl.millis
            && self.watchdog.is_none()
        {
            errors.push(syn::Error::new(
                min_hold.lit.span(),
                "`min_hold` is longer than `ttl`: a holder that dies leaves the lock to expire after \
                 `ttl`, before `min_hold`; raise `ttl` to at least `min_hold`",
            ));
        }
        if let Some((_, 0)) = &self.retries {
            if let Some(wait) = &self.wait {
                errors.push(syn::Error::new(
                    wait.lit.span(),
                    "`wait` has no effect with `retries = 0`: a single attempt never waits; \
                     remove `wait` or allow retries",
                ));
            } else if let Some(delay) = &self.retry_delay {
                errors.push(syn::Error::new(
                    delay.lit.span(),
                    "`retry_delay` has no effect with `retries = 0`: remove it or allow retries",
                ));
            }
        }
    }
}

/// An argument no one knows (its value, if any, is read first so the error stands at the name).
fn unknown(meta: &ParseNestedMeta<'_>, name: &str) -> syn::Error {
    if meta.input.peek(syn::Token![=])
        && let Err(error) = meta.value().and_then(|value| value.parse::<Expr>())
    {
        return error;
    }
    meta.error(format!(
        "unknown argument `{name}`; expected one of {KNOWN}"
    ))
}

/// A string argument that names one of `choices` (`what` is how an unknown one is called):
/// its literal, for spans, and the choice.
fn choice<T: Copy>(
    meta: &ParseNestedMeta<'_>,
    name: &str,
    what: &str,
    choices: &[(&str, T)],
) -> syn::Result<(LitStr, T)> {
    let lit = string(meta, name)?;
    let given = lit.value();
    if let Some(&(_, choice)) = choices.iter().find(|(word, _)| *word == given) {
        return Ok((lit, choice));
    }
    let words: Vec<String> = choices
        .iter()
        .map(|(word, _)| format!("`{word:?}`"))
        .collect();
    let expected = match words.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    Err(syn::Error::new(
        lit.span(),
        format!("unknown {what} {given:?}: expected {expected}"),
    ))
}

/// A whole-number argument from `min` up, such as `retries = 3` (`example` is the 3): its
/// literal, for spans, and the number.
fn whole_number(
    meta: &ParseNestedMeta<'_>,
    name: &str,
    example: u32,
    min: u32,
) -> syn::Result<(LitInt, u32)> {
    let expected = format!("a whole number, as in `{name} = {example}`");
    let lit: LitInt = value(meta, name, &expected)?;
    match lit.base10_parse::<u32>() {
        Ok(n) if n >= min => Ok((lit, n)),
        _ => Err(syn::Error::new(
            lit.span(),
            format!("`{name}` must be a whole number from {min} to 4294967295"),
        )),
    }
}

const ONE_OF_KEY_KEYS: &str =
    "give either `key` (one lock) or `keys` (a set of locks taken together), not both";

/// `keys = ["…", "…"]`: a non-empty list of distinct templates, each checked like `key`.
fn templates(meta: &ParseNestedMeta<'_>) -> syn::Result<Vec<Template>> {
    const EXPECTED: &str = "`keys` takes a list of key templates, as in \
         `keys = [\"account:{from}\", \"account:{to}\"]`";
    if !meta.input.peek(syn::Token![=]) {
        return Err(meta.error(EXPECTED));
    }
    let expr: Expr = meta.value()?.parse()?;
    let Expr::Array(array) = &expr else {
        return Err(syn::Error::new(expr.span(), EXPECTED));
    };
    if array.elems.is_empty() {
        return Err(syn::Error::new(
            array.span(),
            "`keys` needs at least one key template, as in `keys = [\"account:{from}\", \"account:{to}\"]`",
        ));
    }
    let mut errors = Errors::default();
    let mut templates: Vec<Template> = Vec::with_capacity(array.elems.len());
    for elem in &array.elems {
        let Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(lit),
            ..
        }) = elem
        else {
            errors.push(syn::Error::new(
                elem.span(),
                "each of `keys` must be a string literal, as in `\"account:{id}\"`",
            ));
            continue;
        };
        if templates.iter().any(|t| t.lit.value() == lit.value()) {
            errors.push(syn::Error::new(
                lit.span(),
                format!(
                    "duplicate key template {:?} in `keys`: name each lock of the set once",
                    lit.value()
                ),
            ));
            continue;
        }
        match key::parse(lit.clone()) {
            Ok(template) => templates.push(template),
            Err(error) => errors.push(error),
        }
    }
    errors.finish()?;
    Ok(templates)
}

fn value<T: syn::parse::Parse>(
    meta: &ParseNestedMeta<'_>,
    name: &str,
    expected: &str,
) -> syn::Result<T> {
    if !meta.input.peek(syn::Token![=]) {
        return Err(meta.error(format!("`{name}` needs a value: {expected}")));
    }
    let stream = meta.value()?;
    let expr: Expr = stream.parse()?;
    syn::parse2::<T>(quote::ToTokens::to_token_stream(&expr)).map_err(|_| {
        syn::Error::new(
            expr.span(),
            format!("invalid `{name}`: expected {expected}"),
        )
    })
}

fn string(meta: &ParseNestedMeta<'_>, name: &str) -> syn::Result<LitStr> {
    value(meta, name, "a string literal")
}

fn duration_arg(meta: &ParseNestedMeta<'_>, name: &str) -> syn::Result<DurationArg> {
    if !meta.input.peek(syn::Token![=]) {
        return Err(meta.error(format!("`{name}` needs a value, as in `{name} = \"10s\"`")));
    }
    let expr: Expr = meta.value()?.parse()?;
    match &expr {
        Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(lit),
            ..
        }) => duration::parse(name, lit.clone()),
        Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Int(int),
            ..
        }) => Err(syn::Error::new(
            int.span(),
            format!(
                "`{name}` is a string with a unit: write `{name} = \"{}s\"` or `\"{}ms\"`",
                int, int
            ),
        )),
        other => Err(syn::Error::new(
            other.span(),
            format!("`{name}` must be a string literal such as `\"10s\"` or `\"250ms\"`"),
        )),
    }
}

/// A bare flag such as `watchdog`; returns its ident for spans.
fn flag(meta: &ParseNestedMeta<'_>, name: &str) -> syn::Result<Ident> {
    if meta.input.peek(syn::Token![=]) {
        let _: Expr = meta.value()?.parse()?;
        return Err(meta.error(format!(
            "`{name}` is a flag: write `{name}` without a value"
        )));
    }
    meta.path
        .get_ident()
        .cloned()
        .ok_or_else(|| meta.error("expected a flag name"))
}
