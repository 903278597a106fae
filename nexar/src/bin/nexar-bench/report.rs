//! The results table nexar-bench prints (nccl-tests style, with `-I`'s spread columns) and the
//! JSON file it writes.

use std::io::Write;

use nexar::NexarConfig;

use crate::plot;
use crate::spread::Spread;
use crate::{Args, BindTo, Row};

/// Prints the table and writes the JSON; an error when any element came out wrong.
pub(crate) fn report(args: &Args, rows: &[Row], peak_kib: u64) -> Result<(), Box<dyn std::error::Error>> {
    let mode = match (args.inproc, args.bind_to) {
        (true, _) => "one process",
        (false, BindTo::Core) => "separate processes, each runtime thread on a core of its own when they fit",
        (false, BindTo::None) => "separate processes, unbound",
    };
    let transport = match NexarConfig::from_env()? {
        NexarConfig {
            bulk_transport: nexar::BulkTransport::Tcp,
            bulk_min_bytes,
            bulk_encryption,
            lane_cipher,
            lane_threads,
            lane_congestion,
            lane_aes,
            ..
        } => {
            let io = match lane_threads {
                None => "lane I/O on the runtime, from 512 KiB on threads where the host has cores to spare",
                Some(false) => "lane I/O on the runtime",
                Some(true) => "lane I/O on threads",
            };
            let sizes = match (bulk_min_bytes, lane_threads) {
                (Some(b), _) => format!("from {b} B"),
                (None, Some(true)) => "from 256 KiB".into(),
                (None, _) => "all".into(),
            };
            let from = format!("{sizes}, {io}");
            let lanes = match (bulk_encryption, lane_cipher) {
                (false, _) => "TCP lanes UNENCRYPTED".to_string(),
                (true, nexar::LaneCipher::Aegis128X2) => "TLS/TCP lanes sealed with AEGIS-128X2".to_string(),
                (true, nexar::LaneCipher::Aes128Gcm) => {
                    format!("TLS/TCP lanes sealed with AES-128-GCM from {}", lane_aes.resolve())
                }
            };
            let host = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control");
            let congestion = match lane_congestion.name() {
                Some(name) => name.to_string(),
                None => format!("the host's {}", host.as_deref().map(str::trim).unwrap_or("default")),
            };
            format!("QUIC + TLS, collective messages ({from}) on {lanes} ({congestion} congestion control)")
        }
        _ => "QUIC + TLS".to_string(),
    };
    let network = match std::env::var_os("NEXAR_LISTEN_ADDR") {
        Some(_) => "between the ranks' own addresses",
        None => "on loopback",
    };
    let transport = format!("{transport} {network}");
    let transport = if NexarConfig::from_env()?.shared_memory {
        format!("{transport}; collective messages between ranks of one host in shared memory")
    } else {
        transport
    };
    println!(
        "# nexar-bench: {:?} {:?}, {} ranks ({mode}, {transport}), {} iterations after {} warm-ups",
        args.op, args.dtype, args.np, args.iters, args.warmup
    );
    let mut spread_header = if args.per_iteration {
        format!(" {:>10} {:>10} {:>10} {:>8}", "p50(us)", "p99(us)", "max(us)", ">10x(%)")
    } else {
        String::new()
    };
    if args.across_ranks {
        spread_header += &format!(" {:>12} {:>12} {:>12}", "rank-min(us)", "rank-avg(us)", "rank-max(us)");
    }
    // Which algorithm ran, by size, on a line of its own (the table keeps nccl-tests' columns,
    // `#wrong` last).
    if rows.iter().any(|r| !r.algorithm.is_empty()) {
        let by_size: Vec<String> = rows.iter().map(|r| format!("{} B {}", r.bytes, r.algorithm)).collect();
        println!("# algorithm: {}", by_size.join(", "));
    }
    println!(
        "#{:>12} {:>12} {:>12} {:>10} {:>10} {:>8}{spread_header}",
        "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
    );
    let mut json = String::from("[\n");
    for (i, r) in rows.iter().enumerate() {
        let spread = Spread::of(&r.iters);
        let mut spread_cols = if args.per_iteration {
            format!(" {:>10.1} {:>10.1} {:>10.1} {:>8.2}", spread.p50, spread.p99, spread.max, spread.over_10x * 100.0)
        } else {
            String::new()
        };
        if args.across_ranks {
            spread_cols += &match r.across {
                Some([low, avg, high]) => format!(" {low:>12.1} {avg:>12.1} {high:>12.1}"),
                None => format!(" {:>12} {:>12} {:>12}", "-", "-", "-"),
            };
        }
        let across = match r.across {
            Some([low, avg, high]) => {
                format!(", \"rank_min_us\": {low:.3}, \"rank_avg_us\": {avg:.3}, \"rank_max_us\": {high:.3}")
            }
            None => String::new(),
        };
        println!(
            " {:>12} {:>12} {:>12.1} {:>10.3} {:>10.3} {:>8}{spread_cols}",
            r.bytes, r.count, r.time_us, r.algbw, r.busbw, r.wrong
        );
        let iters = if args.per_iteration {
            let all: Vec<String> = r.iters.iter().map(|t| format!("{t:.2}")).collect();
            format!(", \"iter_us\": [{}]", all.join(", "))
        } else {
            String::new()
        };
        json.push_str(&format!(
            "  {{\"op\": \"{:?}\", \"dtype\": \"{:?}\", \"np\": {}, \"bytes\": {}, \"count\": {}, \"time_us\": {:.3}, \"p50_us\": {:.3}, \"p99_us\": {:.3}, \"max_us\": {:.3}, \"over_10x\": {:.5}, \"algbw_gbps\": {:.4}, \"busbw_gbps\": {:.4}, \"wrong\": {}, \"algorithm\": \"{}\"{across}{iters}}}{}\n",
            args.op, args.dtype, args.np, r.bytes, r.count, r.time_us, spread.p50, spread.p99, spread.max, spread.over_10x, r.algbw, r.busbw, r.wrong, r.algorithm, if i + 1 < rows.len() { "," } else { "" }
        ));
    }
    json.push(']');
    let total_wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    print_footer(rows, total_wrong);
    let whose = if args.inproc { "the process" } else { "the largest rank process" };
    println!("# peak RSS of {whose}: {} MiB", peak_kib / 1024);
    std::fs::File::create(&args.json)?.write_all(json.as_bytes())?;
    println!("# results written to {}", args.json);
    if let Some(svg) = &args.plot {
        plot_rows(args, rows, svg)?;
        println!("# bus bandwidth plotted in {}", svg.display());
    }
    if total_wrong > 0 {
        return Err(format!("{total_wrong} wrong elements").into());
    }
    Ok(())
}

/// Draws this run's rows and the `--plot-with` files into `svg`.
fn plot_rows(args: &Args, rows: &[Row], svg: &std::path::Path) -> Result<(), String> {
    let label = format!("nexar {:?} {:?} np{}", args.op, args.dtype, args.np).to_lowercase();
    let points = rows.iter().filter(|r| r.bytes > 0).map(|r| (r.bytes as f64, r.busbw)).collect();
    let mut series = vec![plot::Series { label, points }];
    for file in &args.plot_with {
        series.extend(plot::read_series(file)?);
    }
    let title = format!("bus bandwidth, {} ranks on one host (nexar-bench)", args.np);
    plot::draw(svg, &title, &series)
}

/// The footer nccl-tests prints, which scripts that parse its output look for: the wrong
/// elements over all sizes, and the bus bandwidth averaged over the sizes.
fn print_footer(rows: &[Row], total_wrong: u64) {
    let verdict = if total_wrong == 0 { "OK" } else { "FAILED" };
    println!("# wrong results       : {total_wrong} {verdict}");
    let avg = if rows.is_empty() { 0.0 } else { rows.iter().map(|r| r.busbw).sum::<f64>() / rows.len() as f64 };
    println!("# Avg bus bandwidth   : {avg:.4}");
}
