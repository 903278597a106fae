//! Expansion of `#[nexar::collective_plan]`: check each statement, record the plan, and generate
//! the function that runs it fused.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Expr, FnArg, ItemFn, LitInt, LitStr, Pat, Path, Stmt, Type};

const ALLOWED: &str = "a collective plan may contain only `all_reduce(buf, Op);`, `broadcast(buf, root);`, \
`reduce_scatter(send, recv, Op);`, `all_gather(send, recv);` and `barrier();` statements \
(and, on `f32` buffers, `all_reduce_compressed(buf, Sum | Max | Min, Bf16 | F16);` and \
`all_reduce_topk(buf, Sum, ratio);`)";

const OPS: [&str; 7] = ["Sum", "Prod", "Min", "Max", "BitAnd", "BitOr", "BitXor"];

struct Options {
    krate: Path,
    bucket_bytes: Option<LitInt>,
}

fn parse_options(attr: TokenStream) -> syn::Result<Options> {
    let mut opts = Options { krate: syn::parse_quote!(::nexar), bucket_bytes: None };
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("crate") {
            let lit: LitStr = meta.value()?.parse()?;
            opts.krate = lit.parse()?;
            Ok(())
        } else if meta.path.is_ident("bucket_bytes") {
            let lit: LitInt = meta.value()?.parse()?;
            lit.base10_parse::<usize>()?;
            opts.bucket_bytes = Some(lit);
            Ok(())
        } else {
            Err(meta.error(
                "unknown `#[nexar::collective_plan]` option; expected `bucket_bytes = <usize>` or `crate = \"path\"`",
            ))
        }
    });
    syn::parse::Parser::parse2(parser, attr)?;
    Ok(opts)
}

/// A buffer parameter: its name, element type tokens, and whether it is `&mut`.
struct Param {
    name: syn::Ident,
    ty: Type,
    writable: bool,
}

/// One checked statement.
enum Parsed {
    AllReduce { buf: Use, op: syn::Ident },
    Broadcast { buf: Use, root: LitInt },
    ReduceScatter { send: Use, recv: Use, op: syn::Ident },
    AllGather { send: Use, recv: Use },
    Compressed { buf: Use, op: syn::Ident, compression: syn::Ident },
    TopK { buf: Use, ratio_ppm: u32 },
    Barrier,
}

/// A buffer as a statement names it: its parameter index, and the name at the use site (whose
/// span error messages point at).
struct Use {
    index: usize,
    ident: syn::Ident,
}

fn params(func: &ItemFn) -> syn::Result<(syn::Ident, Vec<Param>)> {
    if !func.sig.generics.params.is_empty() {
        return Err(syn::Error::new(func.sig.generics.span(), "a collective plan cannot be generic"));
    }
    if func.sig.asyncness.is_none() {
        return Err(syn::Error::new(func.sig.fn_token.span(), "a collective plan must be an `async fn`"));
    }
    let mut inputs = func.sig.inputs.iter();
    let comm = match inputs.next() {
        Some(FnArg::Typed(p)) => match &*p.pat {
            Pat::Ident(i) => i.ident.clone(),
            other => {
                return Err(syn::Error::new(other.span(), "name the communicator parameter (`comm: &NexarClient`)"));
            }
        },
        _ => {
            return Err(syn::Error::new(
                func.sig.inputs.span(),
                "a collective plan's first parameter is the communicator (`comm: &NexarClient`)",
            ));
        }
    };
    let mut out = Vec::new();
    for arg in inputs {
        let FnArg::Typed(p) = arg else {
            return Err(syn::Error::new(arg.span(), "a collective plan cannot take `self`"));
        };
        let Pat::Ident(name) = &*p.pat else {
            return Err(syn::Error::new(p.pat.span(), "buffer parameters need plain names"));
        };
        let Type::Reference(r) = &*p.ty else {
            return Err(syn::Error::new(
                p.ty.span(),
                "plan buffers are passed by reference: `&mut` when written, `&` when only read (`&mut Buf<T>`, `&Vec<T>`, ..)",
            ));
        };
        out.push(Param { name: name.ident.clone(), ty: (*r.elem).clone(), writable: r.mutability.is_some() });
    }
    Ok((comm, out))
}

fn buffer(params: &[Param], expr: &Expr, written_by: Option<&str>) -> syn::Result<Use> {
    let Expr::Path(p) = expr else {
        return Err(syn::Error::new(expr.span(), "pass a buffer parameter of this plan by name"));
    };
    let Some(ident) = p.path.get_ident() else {
        return Err(syn::Error::new(expr.span(), "pass a buffer parameter of this plan by name"));
    };
    let i = params
        .iter()
        .position(|prm| prm.name == *ident)
        .ok_or_else(|| syn::Error::new(ident.span(), format!("`{ident}` is not a buffer parameter of this plan")))?;
    if let Some(op) = written_by
        && !params[i].writable
    {
        return Err(syn::Error::new(ident.span(), format!("`{ident}` is written by `{op}`: take it as `&mut`")));
    }
    Ok(Use { index: i, ident: ident.clone() })
}

fn op_ident(expr: &Expr) -> syn::Result<syn::Ident> {
    if let Expr::Path(p) = expr
        && let Some(last) = p.path.segments.last()
        && OPS.contains(&last.ident.to_string().as_str())
    {
        return Ok(last.ident.clone());
    }
    Err(syn::Error::new(
        expr.span(),
        "expected a reduction: `Sum`, `Prod`, `Min`, `Max`, `BitAnd`, `BitOr` or `BitXor`",
    ))
}

fn statement(stmt: &Stmt, params: &[Param]) -> syn::Result<Parsed> {
    let err = || syn::Error::new(stmt.span(), ALLOWED);
    let Stmt::Expr(Expr::Call(call), Some(_)) = stmt else { return Err(err()) };
    let Expr::Path(f) = &*call.func else { return Err(err()) };
    let Some(name) = f.path.get_ident() else { return Err(err()) };
    let args: Vec<&Expr> = call.args.iter().collect();
    let arity = |n: usize| {
        if args.len() == n {
            Ok(())
        } else {
            Err(syn::Error::new(call.span(), format!("`{name}` takes {n} argument(s) in a plan; {ALLOWED}")))
        }
    };
    match name.to_string().as_str() {
        "all_reduce" => {
            arity(2)?;
            Ok(Parsed::AllReduce { buf: buffer(params, args[0], Some("all_reduce"))?, op: op_ident(args[1])? })
        }
        "broadcast" => {
            arity(2)?;
            let Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(root), .. }) = args[1] else {
                return Err(syn::Error::new(args[1].span(), "the root of a planned broadcast is an integer literal"));
            };
            Ok(Parsed::Broadcast { buf: buffer(params, args[0], Some("broadcast"))?, root: root.clone() })
        }
        "reduce_scatter" => {
            arity(3)?;
            Ok(Parsed::ReduceScatter {
                send: buffer(params, args[0], None)?,
                recv: buffer(params, args[1], Some("reduce_scatter"))?,
                op: op_ident(args[2])?,
            })
        }
        "all_gather" => {
            arity(2)?;
            Ok(Parsed::AllGather {
                send: buffer(params, args[0], None)?,
                recv: buffer(params, args[1], Some("all_gather"))?,
            })
        }
        "all_reduce_compressed" => {
            arity(3)?;
            let op = op_ident(args[1])?;
            if !["Sum", "Max", "Min"].contains(&op.to_string().as_str()) {
                return Err(syn::Error::new(op.span(), "a compressed allreduce reduces with `Sum`, `Max` or `Min`"));
            }
            let compression = match args[2] {
                Expr::Path(p) => p.path.segments.last().map(|s| s.ident.clone()),
                _ => None,
            }
            .filter(|c| c == "Bf16" || c == "F16")
            .ok_or_else(|| syn::Error::new(args[2].span(), "expected the wire format: `Bf16` or `F16`"))?;
            Ok(Parsed::Compressed { buf: buffer(params, args[0], Some("all_reduce_compressed"))?, op, compression })
        }
        "all_reduce_topk" => {
            arity(3)?;
            let op = op_ident(args[1])?;
            if op != "Sum" {
                return Err(syn::Error::new(op.span(), "a top-k allreduce sums (`Sum`)"));
            }
            let Expr::Lit(syn::ExprLit { lit: syn::Lit::Float(ratio), .. }) = args[2] else {
                return Err(syn::Error::new(
                    args[2].span(),
                    "the share a planned top-k allreduce sends is a float literal",
                ));
            };
            let value: f64 = ratio.base10_parse()?;
            if !(value > 0.0 && value <= 1.0) {
                return Err(syn::Error::new(ratio.span(), "the share sent is in (0, 1]"));
            }
            let ratio_ppm = ((value * 1e6).round() as u32).max(1);
            Ok(Parsed::TopK { buf: buffer(params, args[0], Some("all_reduce_topk"))?, ratio_ppm })
        }
        "barrier" => {
            arity(0)?;
            Ok(Parsed::Barrier)
        }
        _ => Err(err()),
    }
}

pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let opts = parse_options(attr)?;
    let krate = &opts.krate;
    let func: ItemFn = syn::parse2(item)
        .map_err(|e| syn::Error::new(e.span(), "`#[nexar::collective_plan]` goes on an `async fn`"))?;
    let (comm, params) = params(&func)?;
    let mut parsed = Vec::new();
    let mut errors: Option<syn::Error> = None;
    for stmt in &func.block.stmts {
        match statement(stmt, &params) {
            Ok(p) => parsed.push((p, stmt.span())),
            Err(e) => match &mut errors {
                Some(all) => all.combine(e),
                None => errors = Some(e),
            },
        }
    }
    if let Some(e) = errors {
        return Err(e);
    }
    let mut statements = Vec::new();
    let mut checks = Vec::new();
    let mut text = String::new();
    for (p, _span) in &parsed {
        let (st, check) = match p {
            Parsed::AllReduce { buf, op } => {
                let (i, b) = (buf.index, &buf.ident);
                (
                    quote!(#krate::__private::Statement::AllReduce { buf: #i, op: #krate::ReduceOp::#op }),
                    quote_spanned!(op.span()=> { use #krate::__private::ops::*; #krate::__private::check_reduction(&*#b, #op); }),
                )
            }
            Parsed::Broadcast { buf, root } => {
                let i = buf.index;
                (quote!(#krate::__private::Statement::Broadcast { buf: #i, root: #root }), quote!())
            }
            Parsed::ReduceScatter { send, recv, op } => {
                let (si, ri, s, r) = (send.index, recv.index, &send.ident, &recv.ident);
                (
                    quote!(#krate::__private::Statement::ReduceScatter { send: #si, recv: #ri, op: #krate::ReduceOp::#op }),
                    quote_spanned!(op.span()=> { use #krate::__private::ops::*; #krate::__private::check_reduction(&*#r, #op); }
                        #krate::__private::check_same_dtype(&*#s, &*#r);),
                )
            }
            Parsed::AllGather { send, recv } => {
                let (si, ri, s, r) = (send.index, recv.index, &send.ident, &recv.ident);
                (
                    quote!(#krate::__private::Statement::AllGather { send: #si, recv: #ri }),
                    quote_spanned!(r.span()=> #krate::__private::check_same_dtype(&*#s, &*#r);),
                )
            }
            Parsed::Compressed { buf, op, compression } => {
                let (i, b) = (buf.index, &buf.ident);
                (
                    quote!(#krate::__private::Statement::AllReduceCompressed {
                        buf: #i, op: #krate::ReduceOp::#op, compression: #krate::__private::Compression::#compression
                    }),
                    quote_spanned!(b.span()=> #krate::__private::check_f32(&*#b);),
                )
            }
            Parsed::TopK { buf, ratio_ppm } => {
                let (i, b) = (buf.index, &buf.ident);
                (
                    quote!(#krate::__private::Statement::AllReduceTopK { buf: #i, ratio_ppm: #ratio_ppm }),
                    quote_spanned!(b.span()=> #krate::__private::check_f32(&*#b);),
                )
            }
            Parsed::Barrier => (quote!(#krate::__private::Statement::Barrier), quote!()),
        };
        text.push_str(&st.to_string());
        text.push(';');
        statements.push(st);
        checks.push(check);
    }
    for p in &params {
        let ty = &p.ty;
        text.push_str(&quote!(#ty).to_string());
        text.push(if p.writable { '!' } else { '.' });
    }
    let text: String = text.split_whitespace().collect();
    let adds = params.iter().map(|p| {
        let (n, ty) = (&p.name, &p.ty);
        if p.writable {
            quote_spanned!(ty.span()=> .write(#n as &mut dyn #krate::__private::PlanBuffer))
        } else {
            quote_spanned!(ty.span()=> .read(#n as &dyn #krate::__private::PlanBuffer))
        }
    });
    let shapes: Vec<TokenStream> = params
        .iter()
        .map(|p| {
            let n = &p.name;
            quote!(#krate::__private::shape_of(#n))
        })
        .collect();
    // `explain` takes any plan buffer (`&dyn`), so a parameter type that is not one is
    // reported once, where the plan runs, not again for each `explain`.
    let explain_params: Vec<TokenStream> = params
        .iter()
        .map(|p| {
            let n = &p.name;
            quote!(#n: &dyn #krate::__private::PlanBuffer)
        })
        .collect();
    let bucket = match &opts.bucket_bytes {
        Some(lit) => quote!(#lit),
        None => quote!(#krate::__private::DEFAULT_BUCKET_BYTES),
    };
    let vis = &func.vis;
    let name = &func.sig.ident;
    let inputs = &func.sig.inputs;
    let attrs = &func.attrs;
    let doc = format!("The fused plan of [`{name}`](fn@{name}): its fingerprint, statements and `explain`.");
    // Mixed-site, so a buffer named `world` does not collide with it.
    let world = proc_macro2::Ident::new("world", proc_macro2::Span::mixed_site());
    let comm_ident = proc_macro2::Ident::new("comm", proc_macro2::Span::mixed_site());
    Ok(quote! {
        #(#attrs)*
        #[allow(clippy::too_many_arguments)]
        #vis async fn #name(#inputs) -> ::core::result::Result<(), #krate::CollectiveError> {
            #( #checks )*
            static CACHE: #krate::__private::PlanCache = #krate::__private::PlanCache::new();
            #krate::__private::PlanRun::new(&#name::SPEC, &CACHE)
                #( #adds )*
                .run(#comm)
                .await
        }

        #[doc = #doc]
        #[allow(non_snake_case, dead_code)]
        #vis mod #name {
            #[allow(unused_imports)]
            use super::*;

            /// Compile-time fingerprint of the plan (statements and buffer types); every
            /// collective of the plan carries it, so ranks running other plans are refused.
            pub const FINGERPRINT: u64 = #krate::__private::stable_id(&[module_path!(), #text]);

            /// The recorded plan.
            pub static SPEC: #krate::__private::PlanSpec = #krate::__private::PlanSpec {
                name: module_path!(),
                fingerprint: FINGERPRINT,
                statements: &[ #( #statements ),* ],
                bucket_bytes: #bucket,
            };

            /// How the plan runs for these buffers on `world` ranks: phases, buckets, sizes
            /// and algorithms.
            #[allow(clippy::too_many_arguments)]
            pub fn explain(#( #explain_params, )* #world: usize) -> ::std::string::String {
                SPEC.explain(&[ #( #shapes ),* ], #world)
            }

            /// How the plan runs for these buffers on `comm`, with the algorithms its
            /// configuration picks: exactly what a run there does.
            #[allow(clippy::too_many_arguments)]
            pub fn explain_on(#comm_ident: &#krate::NexarClient, #( #explain_params ),*) -> ::std::string::String {
                SPEC.explain_on(&[ #( #shapes ),* ], #comm_ident)
            }
        }
    })
}
