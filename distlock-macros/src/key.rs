//! Key templates: `"order:{order.id}"` with `{param}`, `{param.field}`, `{self.field}`
//! placeholders and `{{` / `}}` escapes.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::LitStr;

/// A placeholder's path: a root name and fields (names or tuple indices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placeholder {
    pub(crate) root: String,
    pub(crate) fields: Vec<String>,
}

/// A parsed template: the `format!` string and the placeholders in order.
pub(crate) struct Template {
    pub(crate) lit: LitStr,
    pub(crate) format: String,
    pub(crate) placeholders: Vec<Placeholder>,
}

/// Parses the template text; every mistake is reported on the literal.
pub(crate) fn parse(lit: LitStr) -> syn::Result<Template> {
    let text = lit.value();
    let err = |message: String| syn::Error::new(lit.span(), message);
    if text.is_empty() {
        return Err(err("`key` must not be empty".into()));
    }
    let mut format = String::new();
    let mut placeholders = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|&(_, c)| c) == Some('{') => {
                chars.next();
                format.push_str("{{");
            }
            '{' => {
                let rest = &text[at + 1..];
                let Some(end) = rest.find('}') else {
                    return Err(err(format!(
                        "unbalanced `{{` in key {text:?}: close the placeholder with `}}`, \
                         or write `{{{{` for a literal brace"
                    )));
                };
                let inner = &rest[..end];
                placeholders.push(placeholder(inner, &text).map_err(err)?);
                format.push_str("{}");
                for _ in 0..=inner.chars().count() {
                    chars.next();
                }
            }
            '}' if chars.peek().map(|&(_, c)| c) == Some('}') => {
                chars.next();
                format.push_str("}}");
            }
            '}' => {
                return Err(err(format!(
                    "unbalanced `}}` in key {text:?}: write `}}}}` for a literal brace"
                )));
            }
            c => format.push(c),
        }
    }
    Ok(Template {
        lit,
        format,
        placeholders,
    })
}

fn placeholder(inner: &str, text: &str) -> Result<Placeholder, String> {
    if inner.trim().is_empty() {
        return Err(format!(
            "empty placeholder `{{}}` in key {text:?}: name a parameter, as in `{{id}}`"
        ));
    }
    if inner.contains(':') {
        return Err(format!(
            "placeholder `{{{inner}}}` in key {text:?} has a format spec: placeholders use \
             `Display` as they are; format the value into a parameter instead"
        ));
    }
    if inner.contains('{') {
        return Err(format!(
            "unbalanced `{{` in key {text:?}: placeholders cannot nest"
        ));
    }
    let mut parts = inner.split('.');
    let root = parts.next().unwrap_or_default().to_owned();
    if !is_ident(&root) {
        return Err(format!(
            "placeholder `{{{inner}}}` in key {text:?} must start with a parameter name or `self`"
        ));
    }
    let fields: Vec<String> = parts.map(str::to_owned).collect();
    if let Some(bad) = fields
        .iter()
        .find(|f| !is_ident(f) && f.parse::<u32>().is_err())
    {
        return Err(format!(
            "`{bad}` in placeholder `{{{inner}}}` is not a field name: use `{{param.field}}` or `{{param.0}}`"
        ));
    }
    Ok(Placeholder { root, fields })
}

/// Whether `s` is a plain (not raw) Rust identifier, keywords such as `self` included.
fn is_ident(s: &str) -> bool {
    use syn::ext::IdentExt;
    use syn::parse::Parser;
    s != "_"
        && !s.contains('#')
        && syn::Ident::parse_any
            .parse_str(s)
            .is_ok_and(|ident| ident == s)
}

impl Template {
    /// Checks every placeholder root against the function's parameters.
    pub(crate) fn check_roots(&self, params: &[String], has_self: bool) -> syn::Result<()> {
        let mut errors: Option<syn::Error> = None;
        for p in &self.placeholders {
            let known = if p.root == "self" {
                has_self
            } else {
                params.contains(&p.root)
            };
            if !known {
                let listed = if params.is_empty() && !has_self {
                    "the function has no parameters".to_owned()
                } else {
                    let mut names: Vec<String> = params.iter().map(|p| format!("`{p}`")).collect();
                    if has_self {
                        names.insert(0, "`self`".to_owned());
                    }
                    format!("parameters: {}", names.join(", "))
                };
                let message = if p.root == "self" {
                    "`{self…}` in key, but the function has no `self` parameter".to_owned()
                } else {
                    format!(
                        "unknown placeholder `{{{}}}` in key: no parameter named `{}` ({listed})",
                        p.root, p.root
                    )
                };
                let error = syn::Error::new(self.lit.span(), message);
                match &mut errors {
                    Some(all) => all.combine(error),
                    None => errors = Some(error),
                }
            }
        }
        errors.map_or(Ok(()), Err)
    }

    /// The expression that builds the key at run time.
    pub(crate) fn expr(&self) -> TokenStream {
        let span = self.lit.span();
        if self.placeholders.is_empty() {
            let text = self.lit.value();
            return quote_spanned!(span=> #text);
        }
        let format = &self.format;
        let args = self.placeholders.iter().map(|p| path_tokens(p, span));
        quote_spanned!(span=> ::distlock::__private::format!(#format #(, #args)*))
    }
}

fn path_tokens(p: &Placeholder, span: Span) -> TokenStream {
    let root = if p.root == "self" {
        quote_spanned!(span=> self)
    } else {
        let ident = syn::Ident::new(&p.root, span);
        quote!(#ident)
    };
    let fields = p.fields.iter().map(|f| match f.parse::<u32>() {
        Ok(index) => {
            let index = syn::Index { index, span };
            quote!(. #index)
        }
        Err(_) => {
            let ident = syn::Ident::new(f, span);
            quote!(. #ident)
        }
    });
    quote!(#root #(#fields)*)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> syn::Result<Template> {
        parse(LitStr::new(text, Span::call_site()))
    }

    fn error(text: &str) -> String {
        match t(text) {
            Ok(_) => panic!("{text:?} was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn placeholders_and_escapes() {
        let Ok(tpl) = t("order:{order.id}:{{x}}:{self.shard.0}") else {
            panic!()
        };
        assert_eq!(tpl.format, "order:{}:{{x}}:{}");
        assert_eq!(
            tpl.placeholders,
            vec![
                Placeholder {
                    root: "order".into(),
                    fields: vec!["id".into()]
                },
                Placeholder {
                    root: "self".into(),
                    fields: vec!["shard".into(), "0".into()]
                },
            ]
        );
    }

    #[test]
    fn unicode_text_is_kept() {
        let Ok(tpl) = t("订单:{id}:é") else {
            panic!()
        };
        assert_eq!(tpl.format, "订单:{}:é");
    }

    #[test]
    fn mistakes() {
        assert!(error("").contains("must not be empty"));
        assert!(error("a{b").contains("unbalanced `{`"));
        assert!(error("a}b").contains("unbalanced `}`"));
        assert!(error("a{}").contains("empty placeholder"));
        assert!(error("a{id:?}").contains("format spec"));
        assert!(error("a{1x}").contains("must start with a parameter"));
        assert!(error("a{x.-}").contains("not a field name"));
    }

    #[test]
    fn placeholder_names_must_be_identifiers() {
        // Alphanumeric to Unicode but no identifier: a compile error, not a panic.
        assert!(error("a{x²}").contains("must start with a parameter"));
        assert!(error("a{x.y²}").contains("not a field name"));
        let Ok(tpl) = t("{ä.ß}") else { panic!() };
        assert!(!tpl.expr().is_empty());
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Text, braces and placeholder-like pieces made of the characters that matter.
        fn template() -> impl Strategy<Value = String> {
            let piece = prop_oneof![
                Just("{".to_owned()),
                Just("}".to_owned()),
                "[a:.]{0,3}",
                "\\{[x_0.:#² éself]{0,6}\\}",
            ];
            prop_oneof![
                proptest::collection::vec(piece, 0..6).prop_map(|parts| parts.concat()),
                any::<String>(),
            ]
        }

        proptest! {
            #[test]
            fn any_template_parses_or_is_an_error(text in template()) {
                if let Ok(tpl) = t(&text) {
                    let expr = tpl.expr();
                    prop_assert!(!expr.is_empty());
                    let roots = tpl.placeholders.iter().map(|p| p.root.clone()).collect::<Vec<_>>();
                    prop_assert!(tpl.check_roots(&roots, true).is_ok());
                }
            }
        }
    }

    #[test]
    fn roots_must_be_parameters() {
        let Ok(tpl) = t("{order.id}") else { panic!() };
        assert!(tpl.check_roots(&["order".into()], false).is_ok());
        let error = tpl
            .check_roots(&["id".into()], false)
            .unwrap_err()
            .to_string();
        assert!(error.contains("no parameter named `order`"), "{error}");
        let Ok(tpl) = t("{self.id}") else { panic!() };
        assert!(tpl.check_roots(&[], false).is_err());
    }
}
