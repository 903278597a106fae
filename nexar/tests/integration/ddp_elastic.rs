//! Training that survives a dead rank and takes a new one, across real processes: a seed
//! (`nexar seed`) and four processes of `examples/ddp_candle_elastic` train the spiral MLP; one
//! non-zero rank is killed with SIGKILL mid-epoch; the three survivors report the failure
//! naming it, recover, and redo the interrupted step over three ranks; a replacement process
//! joins through the seed, receives the parameters, the optimizer's velocities and the step
//! counter, and the four finish with the target accuracy and identical weights.
//!
//! The example binary is built by `cargo test --workspace` (examples of every member are built
//! before any test runs), or by `cargo build -p nexar-examples --example ddp_candle_elastic`.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::common::TEST_LIMIT;

const NEXAR: &str = env!("CARGO_BIN_EXE_nexar");
/// The heartbeat timeout the ranks run with: a SIGKILLed rank sends no goodbye, so this is
/// how long the survivors take to count it dead.
const HEARTBEAT_TIMEOUT_MS: u64 = 3000;
/// How long the survivors may take from the kill to the failed step: the heartbeat timeout
/// and a generous margin for a loaded two-core machine (timing belongs in benchmarks).
const DETECTION_LIMIT: Duration = Duration::from_secs(60);
/// The rank killed (any non-zero one: rank 0 prints the epoch lines).
const VICTIM: usize = 2;

/// `examples/ddp_candle_elastic` next to this test binary's profile directory.
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    let path = profile_dir.join("examples").join("ddp_candle_elastic");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build -p nexar-examples --example ddp_candle_elastic` \
         (cargo test --workspace does)",
        path.display()
    );
    path
}

/// A line a process printed on stdout, and when the test read it.
#[derive(Clone, Debug)]
struct Line {
    who: String,
    text: String,
    at: Instant,
}

/// Every process's output: stdout lines as they come (to wait on), and everything (stdout and
/// stderr) for the failure messages.
struct Output {
    tx: mpsc::UnboundedSender<Line>,
    rx: mpsc::UnboundedReceiver<Line>,
    seen: Vec<Line>,
    log: Arc<Mutex<String>>,
    /// The forwarding tasks of each process's pipes.
    readers: Vec<(String, tokio::task::JoinHandle<()>)>,
}

impl Output {
    fn new() -> Output {
        let (tx, rx) = mpsc::unbounded_channel();
        Output { tx, rx, seen: Vec::new(), log: Arc::default(), readers: Vec::new() }
    }

    /// Forwards `child`'s stdout (to wait on and to the log) and stderr (to the log).
    fn follow(&mut self, who: &str, child: &mut Child) {
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        self.forward(who, out, Some(self.tx.clone()));
        self.forward(who, err, None);
    }

    fn forward(
        &mut self,
        who: &str,
        pipe: impl AsyncRead + Unpin + Send + 'static,
        tx: Option<mpsc::UnboundedSender<Line>>,
    ) {
        let (name, log) = (who.to_string(), self.log.clone());
        let stream = if tx.is_some() { "out" } else { "err" };
        let who = name.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(pipe).lines();
            while let Ok(Some(text)) = lines.next_line().await {
                log.lock().unwrap().push_str(&format!("[{who} {stream}] {text}\n"));
                if let Some(tx) = &tx {
                    let _ = tx.send(Line { who: who.clone(), text, at: Instant::now() });
                }
            }
        });
        self.readers.push((name, reader));
    }

    /// Waits until `who`'s pipes are read to their end (it has exited) and takes in its lines.
    async fn read_to_end(&mut self, who: &str) {
        for (name, reader) in &mut self.readers {
            if name == who {
                let _ = tokio::time::timeout(Duration::from_secs(30), reader).await;
            }
        }
        self.drain();
    }

    fn dump(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The first stdout line (since the start) of `who` (any process if `None`) that `matches`,
    /// waiting for it at most `limit`.
    async fn wait_for(
        &mut self,
        who: Option<&str>,
        what: &str,
        limit: Duration,
        matches: impl Fn(&str) -> bool,
    ) -> Line {
        let fits = |l: &Line| who.is_none_or(|w| w == l.who) && matches(&l.text);
        if let Some(l) = self.seen.iter().find(|l| fits(l)) {
            return l.clone();
        }
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(line)) => {
                    self.seen.push(line.clone());
                    if fits(&line) {
                        return line;
                    }
                }
                Ok(None) => unreachable!("the test holds a sender"),
                Err(_) => panic!("no line {what} from {who:?} within {limit:?}; the output:\n{}", self.dump()),
            }
        }
    }

    /// Takes in the lines that have arrived so far.
    fn drain(&mut self) {
        while let Ok(line) = self.rx.try_recv() {
            self.seen.push(line);
        }
    }

    fn lines_of(&self, who: &str) -> Vec<&str> {
        self.seen.iter().filter(|l| l.who == who).map(|l| l.text.as_str()).collect()
    }
}

/// Starts `nexar seed` for `world` ranks and returns it with its address and token. It stays
/// up (the replacement joins through it) until the test drops it.
async fn start_seed(world: usize, output: &mut Output) -> (Child, String, String) {
    let mut child = Command::new(NEXAR)
        .args(["seed", "--bind", "127.0.0.1:0", "--world-size", &world.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the seed");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut addr, mut token) = (None, None);
    while addr.is_none() || token.is_none() {
        let line = lines.next_line().await.unwrap().expect("the seed exited before printing its token");
        if let Some(a) = line.strip_prefix("listening: ") {
            addr = Some(a.to_string());
        }
        if let Some(t) = line.strip_prefix("token: ") {
            token = Some(t.to_string());
        }
    }
    // Keep reading: a seed whose stdout is closed fails on its next line.
    output.forward("seed", lines.into_inner(), None);
    output.forward("seed", child.stderr.take().unwrap(), None);
    (child, addr.unwrap(), token.unwrap())
}

fn trainer(addr: &str, token: &str, join: bool) -> Command {
    let mut cmd = Command::new(example());
    cmd.env("NEXAR_SEED_ADDR", addr)
        .env("NEXAR_TOKEN", token)
        .env("NEXAR_LISTEN_ADDR", "127.0.0.1:0")
        .env("NEXAR_HEARTBEAT_TIMEOUT_MS", HEARTBEAT_TIMEOUT_MS.to_string())
        .env("NEXAR_HEARTBEAT_INTERVAL_MS", (HEARTBEAT_TIMEOUT_MS / 10).to_string())
        // Bounds the members' wait for the replacement (and its wait to be admitted).
        .env("NEXAR_JOIN_TIMEOUT_MS", "90000")
        .env("NEXAR_LOG", "warn")
        .env("ELASTIC_WORLD", "4")
        .env("ELASTIC_EPOCHS", "30")
        // A pause per step, so the 270 steps take seconds and the kill lands mid-epoch.
        .env("ELASTIC_STEP_MS", "15")
        // Five processes share the machine: one compute thread each.
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("ELASTIC_JOIN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if join {
        cmd.env("ELASTIC_JOIN", "1");
    }
    cmd
}

/// The number after `key` in `text` (`"redoing step 19"`, key `"redoing step "`).
fn number_after(text: &str, key: &str) -> u64 {
    let rest = text.split(key).nth(1).unwrap_or_else(|| panic!("no `{key}` in: {text}"));
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap_or_else(|_| panic!("no number after `{key}` in: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_is_survived_and_replaced_and_training_reaches_its_accuracy() {
    let started = Instant::now();
    let mut output = Output::new();
    let (_seed, addr, token) = start_seed(4, &mut output).await;
    let mut procs: Vec<(String, Child)> = (0..4)
        .map(|i| {
            let who = format!("trainer {i}");
            let mut child = trainer(&addr, &token, false).spawn().expect("start examples/ddp_candle_elastic");
            output.follow(&who, &mut child);
            (who, child)
        })
        .collect();
    let result = tokio::time::timeout(TEST_LIMIT, scenario(&mut output, &mut procs, &addr, &token)).await;
    if result.is_err() {
        for (_, child) in &mut procs {
            let _ = child.start_kill();
        }
        panic!("the test ran past {TEST_LIMIT:?}; the output:\n{}", output.dump());
    }
    println!("the whole run took {:?}", started.elapsed());
}

async fn scenario(output: &mut Output, procs: &mut Vec<(String, Child)>, addr: &str, token: &str) {
    const STEP: Duration = Duration::from_secs(120);
    // Which process holds which rank (the seed numbers them in the order they join).
    let mut rank_of = std::collections::HashMap::new();
    for (who, _) in procs.iter() {
        let line = output.wait_for(Some(who), "`started`", STEP, |t| t.ends_with(": started, world 4")).await;
        rank_of.insert(who.clone(), number_after(&line.text, "rank ") as usize);
    }
    let mut ranks: Vec<usize> = rank_of.values().copied().collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2, 3], "{rank_of:?}");

    // Training is under way: kill the victim in the middle of epoch 1.
    output.wait_for(None, "for the middle of epoch 1", STEP, |t| t.starts_with("epoch 1 step 4 world 4")).await;
    let at = procs.iter().position(|(who, _)| rank_of[who] == VICTIM).unwrap();
    let (victim, mut child) = procs.remove(at);
    child.start_kill().expect("SIGKILL the victim");
    let killed_at = Instant::now();
    let status = child.wait().await.unwrap();
    assert!(!status.success(), "{victim} was killed: {status:?}");

    // Each survivor's step fails naming the dead rank, within the heartbeat timeout and a
    // margin; each recovers to world 3 and all redo the same step.
    let survivors: Vec<String> = procs.iter().map(|(who, _)| who.clone()).collect();
    let mut redone = Vec::new();
    for who in &survivors {
        let failed = output.wait_for(Some(who), "`failed`", STEP, |t| t.contains(" failed: ")).await;
        let after = failed.at - killed_at;
        println!("{who} (rank {}) reported the failure {after:?} after the kill: {}", rank_of[who], failed.text);
        assert!(after < DETECTION_LIMIT, "{who} took {after:?} to see the failure: {}", failed.text);
        let names_victim =
            [format!("rank {VICTIM} is gone"), format!("from rank {VICTIM} within"), format!("(peer {VICTIM})")];
        assert!(
            names_victim.iter().any(|n| failed.text.contains(n.as_str())),
            "{who}'s error does not name rank {VICTIM}: {}",
            failed.text
        );
        let failed_step = number_after(&failed.text, ": step ");
        let recovered = output.wait_for(Some(who), "`recovered`", STEP, |t| t.contains(": recovered, world ")).await;
        println!("{who}: {} ({:?} after the kill)", recovered.text, recovered.at - killed_at);
        assert!(recovered.text.contains(": recovered, world 3, redoing step "), "{}", recovered.text);
        let redo = number_after(&recovered.text, "redoing step ");
        // The step every survivor goes on from is the newest any finished: the failed one, or
        // the next for a survivor whose allreduce completed before the others' failed.
        assert!(redo == failed_step || redo == failed_step + 1, "{who} failed step {failed_step}, redoes {redo}");
        redone.push(redo);
    }
    assert!(redone.iter().all(|s| *s == redone[0]), "the survivors redo different steps: {redone:?}");
    let redo = redone[0];
    assert!((9..27).contains(&redo), "killed in epoch 1 (steps 9 to 17), the redone step is {redo}");
    for who in &survivors {
        let want = format!("step {redo} redone over 3 ranks (32 samples each)");
        output.wait_for(Some(who), "`redone`", STEP, |t| t.ends_with(want.as_str())).await;
    }

    // A replacement joins through the seed and is admitted at the next epoch boundary.
    let spawned = Instant::now();
    let mut joiner = trainer(addr, token, true).spawn().expect("start the replacement");
    output.follow("joiner", &mut joiner);
    procs.push(("joiner".to_string(), joiner));
    let joined = output.wait_for(Some("joiner"), "`joined as`", STEP, |t| t.contains(": joined as rank ")).await;
    println!("joiner: {} ({:?} after it started)", joined.text, joined.at - spawned);
    assert!(joined.text.starts_with("rank 3: joined as rank 3 at epoch "), "{}", joined.text);
    assert!(joined.text.contains(" step 0, world 4"), "admitted at an epoch boundary: {}", joined.text);
    let joined_epoch = number_after(&joined.text, "at epoch ");
    assert!(joined_epoch * 9 > redo, "joined at epoch {joined_epoch}, after the redone step {redo}");
    for who in &survivors {
        output.wait_for(Some(who), "`grown`", STEP, |t| t.ends_with(": grown, world 4")).await;
    }

    // All four finish: exit 0, the target accuracy, the same weights.
    for (who, child) in procs.iter_mut() {
        let status = tokio::time::timeout(STEP, child.wait()).await.expect("a trainer did not finish").unwrap();
        output.read_to_end(who).await;
        assert!(status.success(), "{who} failed ({status:?}); the output:\n{}", output.dump());
    }
    let mut finished = Vec::new();
    for (who, _) in procs.iter() {
        let done = output.wait_for(Some(who), "`done`", STEP, |t| t.contains(": done, world ")).await;
        assert!(done.text.contains(": done, world 4, test accuracy "), "{who}: {}", done.text);
        assert!(done.text.ends_with("%, weights identical"), "{who}: {}", done.text);
        let accuracy: f64 =
            done.text.split("test accuracy ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!(accuracy > 95.0, "{who}: {}", done.text);
        finished.push(number_after(&done.text, "rank ") as usize);
    }
    finished.sort_unstable();
    assert_eq!(finished, [0, 1, 2, 3], "the ranks of the final world");
    let summary = output
        .wait_for(None, "the summary", STEP, |t| t.starts_with("ddp_candle_elastic: 4 ranks at the end, 30 epochs"))
        .await;
    assert!(summary.text.contains("1 recoveries, 1 growths"), "{}", summary.text);
    assert!(summary.text.ends_with("weights identical on every rank"), "{}", summary.text);
    // Rank 0's epoch lines: four ranks, then three, then four again to the end.
    let rank0 = procs.iter().find(|(who, _)| who != "joiner" && rank_of[who] == 0).map(|(w, _)| w.clone()).unwrap();
    let worlds: Vec<u64> = output
        .lines_of(&rank0)
        .iter()
        .filter(|t| t.starts_with("epoch ") && t.contains(" done at step "))
        .map(|t| number_after(t, ", world "))
        .collect();
    assert_eq!(worlds.len(), 30, "{worlds:?}");
    let mut phases = worlds.clone();
    phases.dedup();
    assert_eq!(phases, [4, 3, 4], "the world over the epochs: {worlds:?}");
    println!("{}", summary.text);
}
