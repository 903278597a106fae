//! Expansion of `#[nexar::rpc]`: parse and check the function, then generate the endpoint module.

use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, LitInt, LitStr, Pat, Path, ReturnType, Type};

/// What the attribute's arguments say.
struct Options {
    id: Option<LitInt>,
    krate: Path,
}

fn parse_options(attr: TokenStream) -> syn::Result<Options> {
    let mut opts = Options { id: None, krate: syn::parse_quote!(::nexar) };
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("id") {
            let lit: LitInt = meta.value()?.parse()?;
            lit.base10_parse::<u64>()?;
            opts.id = Some(lit);
            Ok(())
        } else if meta.path.is_ident("crate") {
            let lit: LitStr = meta.value()?.parse()?;
            opts.krate = lit.parse()?;
            Ok(())
        } else {
            Err(meta.error("unknown `#[nexar::rpc]` option; expected `id = <u64>` or `crate = \"path\"`"))
        }
    });
    syn::parse::Parser::parse2(parser, attr)?;
    Ok(opts)
}

/// For a pinned id, an exported macro named after it: `#[macro_export]` puts every such macro
/// at the crate root, so two functions pinning one id in a crate fail to compile, the error
/// pointing at both `id = ..` values. (Across crates the registry still refuses a duplicate
/// at startup, naming both functions.)
fn pinned_id_guard(id: Option<&LitInt>) -> syn::Result<TokenStream> {
    let Some(lit) = id else { return Ok(TokenStream::new()) };
    let value: u64 = lit.base10_parse()?;
    let guard =
        format_ident!("nexar_rpc_id_{}_is_pinned_by_two_functions_give_one_another_id", value, span = lit.span());
    Ok(quote! {
        #[doc(hidden)]
        #[macro_export]
        macro_rules! #guard { () => {}; }
    })
}

/// What a parameter of an RPC function receives.
enum Kind {
    /// An argument the caller sends.
    Wire,
    /// The call's `RpcContext`, by value or (`by_ref`) by reference.
    Context { by_ref: bool },
    /// Application state, `State<T>`: the rank's `T`.
    State(Box<Type>),
}

/// One parameter of an RPC function.
struct Param {
    name: syn::Ident,
    ty: Type,
    kind: Kind,
}

/// The last segment of `ty`'s path, if it is a plain path.
fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        _ => None,
    }
}

/// What a parameter of type `ty` receives, recognised by the type's name as written
/// (`RpcContext`, `&RpcContext`, `State<T>`, through any path).
fn kind_of(ty: &Type) -> syn::Result<Kind> {
    let is_context = |t: &Type| {
        last_segment(t).is_some_and(|s| s.ident == "RpcContext" && matches!(s.arguments, syn::PathArguments::None))
    };
    if let Type::Reference(r) = ty
        && is_context(&r.elem)
    {
        if r.mutability.is_some() {
            return Err(syn::Error::new_spanned(
                ty,
                "take the call's context as `&RpcContext` or `RpcContext`, not `&mut`",
            ));
        }
        return Ok(Kind::Context { by_ref: true });
    }
    if is_context(ty) {
        return Ok(Kind::Context { by_ref: false });
    }
    if let Some(seg) = last_segment(ty).filter(|s| s.ident == "State")
        && let syn::PathArguments::AngleBracketed(args) = &seg.arguments
        && let [syn::GenericArgument::Type(inner)] = args.args.iter().collect::<Vec<_>>()[..]
    {
        return Ok(Kind::State(Box::new(inner.clone())));
    }
    Ok(Kind::Wire)
}

/// The function's parameters, refusing what an endpoint cannot have. Every problem is
/// reported, each at its own tokens.
fn parameters(func: &ItemFn) -> syn::Result<Vec<Param>> {
    let mut errors: Option<syn::Error> = None;
    let mut fail = |e: syn::Error| match &mut errors {
        Some(all) => all.combine(e),
        None => errors = Some(e),
    };
    if let Some(receiver) = func.sig.receiver() {
        fail(syn::Error::new(
            receiver.span(),
            "`#[nexar::rpc]` cannot be used on a method with `self`: make it a free function and pass the state it needs as arguments (or as `State<T>`)",
        ));
    }
    if !func.sig.generics.params.is_empty() || func.sig.generics.where_clause.is_some() {
        fail(syn::Error::new(
            func.sig.generics.span(),
            "`#[nexar::rpc]` functions cannot be generic: an endpoint has one concrete signature (write one function per type)",
        ));
    }
    if let Some(v) = &func.sig.variadic {
        fail(syn::Error::new(v.span(), "`#[nexar::rpc]` functions cannot be variadic"));
    }
    let mut params = Vec::new();
    let mut context_seen = false;
    for arg in &func.sig.inputs {
        let FnArg::Typed(pat) = arg else { continue };
        let name = match &*pat.pat {
            Pat::Ident(ident) if ident.by_ref.is_none() && ident.subpat.is_none() => ident.ident.clone(),
            other => {
                fail(syn::Error::new_spanned(
                    other,
                    "`#[nexar::rpc]` arguments need plain names (`id: u32`), not patterns",
                ));
                continue;
            }
        };
        match kind_of(&pat.ty) {
            Ok(Kind::Context { .. }) if context_seen => {
                fail(syn::Error::new_spanned(&pat.ty, "`#[nexar::rpc]` functions take the call's context once"));
            }
            Ok(kind) => {
                context_seen |= matches!(kind, Kind::Context { .. });
                params.push(Param { name, ty: (*pat.ty).clone(), kind });
            }
            Err(e) => fail(e),
        }
    }
    match errors {
        Some(e) => Err(e),
        None => Ok(params),
    }
}

/// Signature text used in the id: the argument and result types as written, with all
/// whitespace removed so the text (and the id) does not depend on how tokens are printed.
fn signature_text(types: &[Type], ret: &Type) -> String {
    let compact = |t: &Type| quote!(#t).to_string().split_whitespace().collect::<String>();
    let args: Vec<String> = types.iter().map(compact).collect();
    format!("fn({})->{}", args.join(","), compact(ret))
}

pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let opts = parse_options(attr)?;
    let func: ItemFn = syn::parse2(item)
        .map_err(|e| syn::Error::new(e.span(), "`#[nexar::rpc]` goes on a function (`async fn` or `fn`)"))?;
    let params = parameters(&func)?;
    // The arguments a caller sends; the context and state are the serving rank's own.
    let args: Vec<(syn::Ident, Type)> =
        params.iter().filter(|p| matches!(p.kind, Kind::Wire)).map(|p| (p.name.clone(), p.ty.clone())).collect();
    let krate = &opts.krate;
    let name = &func.sig.ident;
    let vis = &func.vis;
    let names: Vec<&syn::Ident> = args.iter().map(|(n, _)| n).collect();
    let types: Vec<&Type> = args.iter().map(|(_, t)| t).collect();
    let ret: Type = match &func.sig.output {
        ReturnType::Default => syn::parse_quote!(()),
        ReturnType::Type(_, ty) => (**ty).clone(),
    };
    let signature = signature_text(&args.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>(), &ret);
    let id = match &opts.id {
        Some(lit) => quote!(#lit),
        None => quote!(#krate::__private::stable_id(&[NAME, SIGNATURE])),
    };
    let pinned_once = pinned_id_guard(opts.id.as_ref())?;
    // Everything generated is spanned with mixed-site hygiene, so its local variables (`client`,
    // `peer`, `world`, `parts`, ..) never meet the user's arguments of the same names: an
    // argument named `world` is sent as given, not as the world size. Locals that appear inside
    // a user-spanned fragment are made mixed-site explicitly.
    let site = Span::mixed_site();
    let [client, peer, parts, reply, out, ctx, body] =
        ["client", "peer", "parts", "reply", "out", "ctx", "body"].map(|n| Ident::new(n, site));
    let call_await = if func.sig.asyncness.is_some() { quote_spanned!(site=> .await) } else { quote!() };
    // Every use of a user type is spanned at that type, so a type that cannot travel gives one
    // error, at the user's token, with the RpcValue message.
    let codec = |what: TokenStream| quote_spanned!(site=> #what.map_err(|what| #krate::RpcError::Codec { rank: #client.rank(), peer: #peer, name: NAME, what }));
    let count = args.len();
    // Each argument is serialised once, straight into the request body.
    let encode_each = args.iter().map(
        |(n, ty)| quote_spanned! {ty.span()=> (#krate::__private::codec::<#ty>().encode_into)(&#n, &mut #body)?; },
    );
    let encode_args = codec(quote_spanned!(site=> (|| {
        #[allow(unused_mut)]
        let mut #body = #krate::__private::BodyWriter::new(#count);
        #( #encode_each )*
        #body.finish()
    })()));
    let decode_ret = quote_spanned! {ret.span()=> (#krate::__private::codec::<#ret>().decode)(&#reply) };
    let decode_reply = codec(decode_ret);
    let decode_each = args.iter().map(|(n, ty)| {
        quote_spanned! {ty.span()=> let #n: #ty = (#krate::__private::codec::<#ty>().decode)(#parts.next().unwrap_or_default())?; }
    });
    // The serving rank's own parameters: state looked up, and what the call passes for each
    // parameter, in the function's order.
    let take_state = params.iter().filter_map(|p| match &p.kind {
        Kind::State(inner) => {
            let (n, ty) = (&p.name, &p.ty);
            Some(quote_spanned! {ty.span()=> let #n: #ty = #ctx.__state::<#inner>()?; })
        }
        _ => None,
    });
    let call_args = params.iter().map(|p| match p.kind {
        Kind::Context { by_ref: true } => quote_spanned!(site=> &#ctx),
        Kind::Context { by_ref: false } => quote_spanned!(site=> ::core::clone::Clone::clone(&#ctx)),
        Kind::Wire | Kind::State(_) => {
            let n = &p.name;
            quote!(#n)
        }
    });
    let encode_ret = quote_spanned! {ret.span()=> (#krate::__private::codec::<#ret>().encode)(&#out) };
    let handle = format_ident!("__nexar_rpc_handle");
    let doc = format!(
        "RPC endpoint of [`{name}`](fn@{name}): `{name}::call(&client, peer, ..)` runs it on rank `peer`, `{name}::call_all` on every rank."
    );
    Ok(quote_spanned! {site=>
        #func

        #pinned_once

        #[doc = #doc]
        #[allow(non_camel_case_types, non_snake_case, dead_code, clippy::unused_unit)]
        #vis mod #name {
            #[allow(unused_imports)]
            use super::*;

            /// Path of the function (this module is named after it, so its path ends in the name).
            pub const NAME: &str = module_path!();
            /// The signature the id is derived from.
            pub const SIGNATURE: &str = #signature;
            /// The function's stable id.
            pub const ID: u64 = #id;
            /// Hash of [`SIGNATURE`], compared by the serving rank.
            pub const SIG_HASH: u64 = #krate::__private::stable_id(&[SIGNATURE]);

            /// Runs the function on rank `peer` and returns its result.
            pub async fn call(
                client: &#krate::NexarClient,
                peer: usize,
                #( #names: #types ),*
            ) -> ::core::result::Result<#ret, #krate::RpcError> {
                let args = #encode_args?;
                let reply = client.__rpc_call(peer, ID, SIG_HASH, NAME, SIGNATURE, args).await?;
                #decode_reply
            }

            /// Runs the function on every rank (this one included), concurrently; results by rank.
            pub async fn call_all(
                client: &#krate::NexarClient,
                #( #names: #types ),*
            ) -> ::std::vec::Vec<::core::result::Result<#ret, #krate::RpcError>> {
                let world = client.world_size();
                let peer = client.rank();
                let args = match #encode_args {
                    Ok(args) => args,
                    Err(e) => return (0..world).map(|_| Err(e.clone())).collect(),
                };
                let mut calls = ::std::vec::Vec::with_capacity(world);
                for peer in 0..world {
                    let (client, args) = (client.clone(), args.clone());
                    calls.push(#krate::__private::spawn(async move {
                        let reply = client.__rpc_call(peer, ID, SIG_HASH, NAME, SIGNATURE, args).await?;
                        #decode_reply
                    }));
                }
                let mut out = ::std::vec::Vec::with_capacity(world);
                for (peer, call) in calls.into_iter().enumerate() {
                    out.push(#krate::__private::join(call, client.rank(), peer, NAME).await);
                }
                out
            }

            fn #handle(#ctx: #krate::rpc::RpcContext, body: #krate::__private::RpcBytes) -> #krate::__private::HandlerFuture {
                ::std::boxed::Box::pin(async move {
                    #[allow(unused_mut, unused_variables)]
                    let mut parts = #krate::__private::decode_parts(&body, #count)?;
                    #( #decode_each )*
                    #( #take_state )*
                    let out: #ret = super::#name( #( #call_args ),* ) #call_await;
                    ::core::result::Result::Ok(#encode_ret?)
                })
            }

            #krate::__private::inventory::submit! {
                #krate::__private::RpcHandler {
                    id: ID,
                    sig_hash: SIG_HASH,
                    name: NAME,
                    signature: SIGNATURE,
                    handle: #handle,
                }
            }
        }
    })
}
