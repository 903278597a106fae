//! The stall inspector's report: from the other members' answers to "where are you on this
//! communicator?", one line that says who a stalled collective waits for and why.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use nexar_types::DType;

use crate::proto::algo::name_of_code;
use crate::proto::message::ActiveColl;

/// The collective that stalls, as this rank called it.
#[derive(Clone, Debug)]
pub(crate) struct StalledOp {
    pub comm: u64,
    pub seq: u64,
    pub kind: u8,
    pub dtype: DType,
    pub count: u64,
    pub root: Option<u32>,
    /// How long it has waited for `waiting_for`.
    pub waited: Duration,
    /// The world rank whose message it waits for.
    pub waiting_for: usize,
}

/// What one other member said, or why it said nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Its collectives in flight on the communicator and how far it got.
    Position { active: Vec<ActiveColl>, last_started: Option<u64>, last_completed: Option<u64> },
    /// It did not answer in time.
    Unresponsive,
    /// It is known dead, for this reason.
    Dead(String),
}

/// One member's answer.
#[derive(Clone, Debug)]
pub(crate) struct Reply {
    /// World rank.
    pub rank: usize,
    pub answer: Answer,
    /// The collectives it was last seen in on the communicator, oldest first (see
    /// `trace/last_seen.rs`): what the report says of it when it can no longer say itself.
    pub seen: Vec<ActiveColl>,
}

/// `1 KiB`, `4 MiB`, `612 B`.
fn size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, scale) in UNITS {
        if bytes >= scale {
            let value = bytes as f64 / scale as f64;
            return if value.fract() == 0.0 { format!("{value:.0} {unit}") } else { format!("{value:.1} {unit}") };
        }
    }
    format!("{bytes} B")
}

fn seconds(d: Duration) -> String {
    if d >= Duration::from_secs(10) { format!("{} s", d.as_secs()) } else { format!("{:.1} s", d.as_secs_f64()) }
}

/// "rank 3", "ranks 0 and 1", "ranks 0, 4-9 and 12".
pub(crate) fn ranks(list: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in list {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == r => *end = r,
            _ => runs.push((r, r)),
        }
    }
    let words: Vec<String> = runs
        .iter()
        .flat_map(|&(a, b)| match b - a {
            0 => vec![a.to_string()],
            1 => vec![a.to_string(), b.to_string()],
            _ => vec![format!("{a}-{b}")],
        })
        .collect();
    match words.as_slice() {
        [one] if list.len() == 1 => format!("rank {one}"),
        [one] => format!("ranks {one}"),
        [init @ .., last] => format!("ranks {} and {last}", init.join(", ")),
        [] => "no rank".to_string(),
    }
}

fn describe(c: &ActiveColl) -> String {
    let mut text = format!("{} #{}", name_of_code(c.kind), c.seq);
    if let Some(root) = c.root {
        let _ = write!(text, " (root {root})");
    }
    text
}

/// A call in full, as a member was last seen making it: "broadcast #3 of 1024 f32 (root 0)".
fn describe_call(c: &ActiveColl) -> String {
    let dtype = DType::from_wire(c.dtype).map_or("unknown", |d| d.name());
    let mut text = format!("{} #{} of {} {dtype}", name_of_code(c.kind), c.seq, c.count);
    if let Some(root) = c.root {
        let _ = write!(text, " (root {root})");
    }
    text
}

/// Why `theirs`, at the same sequence number, is not the call `mine` made.
fn difference(mine: &StalledOp, theirs: &ActiveColl) -> Option<String> {
    let dtype_name = |c: u8| DType::from_wire(c).map_or("unknown", |d| d.name());
    if theirs.kind != mine.kind {
        Some("the ranks called different collectives".into())
    } else if theirs.dtype != mine.dtype.to_wire() {
        Some(format!("it passed {} elements, this rank {}", dtype_name(theirs.dtype), mine.dtype.name()))
    } else if theirs.count != mine.count {
        Some(format!("it passed {} elements, this rank {}", theirs.count, mine.count))
    } else if theirs.root != mine.root {
        Some("the ranks named different roots".into())
    } else {
        None
    }
}

/// The one-line report of a stalled collective: what it is, whom it waits for, and for every
/// other member where it is — grouped, so a 64-rank job stays one readable line.
pub(crate) fn stall_report(mine: &StalledOp, replies: &[Reply]) -> String {
    let mut line = format!(
        "{} #{} on comm {} ({} {}) has waited {} for rank {}",
        name_of_code(mine.kind),
        mine.seq,
        mine.comm,
        size(mine.count.saturating_mul(mine.dtype.size() as u64)),
        mine.dtype.name(),
        seconds(mine.waited),
        mine.waiting_for
    );
    // Members with the same story are named together.
    let mut stories: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut replies: Vec<&Reply> = replies.iter().collect();
    replies.sort_by_key(|r| (r.rank != mine.waiting_for, r.rank));
    for reply in replies {
        let story = story_of(mine, reply);
        if !stories.contains_key(&story) {
            order.push(story.clone());
        }
        stories.entry(story).or_default().push(reply.rank);
    }
    for (i, story) in order.iter().enumerate() {
        let mut members = stories[story].clone();
        members.sort_unstable();
        let who = ranks(&members);
        let story = if members.len() > 1 { plural(story) } else { story.clone() };
        let _ = write!(line, "{}{who} {story}", if i == 0 { ": " } else { "; " });
    }
    line
}

/// A story told of several ranks: its verbs in the plural.
fn plural(story: &str) -> String {
    let words: Vec<&str> = story
        .split(' ')
        .map(|w| match w {
            "is" => "are",
            "has" => "have",
            w => w,
        })
        .collect();
    words.join(" ")
}

/// What one member's answer says, as the words after its rank ("is in broadcast #3 ...").
fn story_of(mine: &StalledOp, reply: &Reply) -> String {
    // How a call it was seen making differs from this rank's, at the same sequence number.
    let differs = |c: &ActiveColl| {
        let why = (c.seq == mine.seq).then(|| difference(mine, c)).flatten();
        why.map_or(String::new(), |why| format!(" — {why}"))
    };
    let last_seen = || {
        let c = reply.seen.iter().find(|c| c.seq == mine.seq).or(reply.seen.last());
        c.map_or(String::new(), |c| format!(", last seen in {}{}", describe_call(c), differs(c)))
    };
    let (active, last_started, last_completed) = match &reply.answer {
        Answer::Dead(reason) => return format!("is dead ({reason}){}", last_seen()),
        Answer::Unresponsive => {
            return format!("is unresponsive: it did not answer the stall inspector{}", last_seen());
        }
        Answer::Position { active, last_started, last_completed } => (active, *last_started, *last_completed),
    };
    let waits = |c: &ActiveColl| match c.waiting_on {
        Some(peer) if reply.rank == mine.waiting_for => format!(", waiting for rank {peer}"),
        _ => String::new(),
    };
    if let Some(same) = active.iter().find(|c| c.seq == mine.seq) {
        return match difference(mine, same) {
            Some(why) => format!("is in {} — {why}", describe(same)),
            None => format!("is in {} too{}", describe(same), waits(same)),
        };
    }
    if let Some(c) = active.iter().find(|c| c.seq < mine.seq) {
        return format!("is still in {}{}", describe(c), waits(c));
    }
    if let Some(c) = active.first() {
        return format!("is already in {}", describe(c));
    }
    match (last_started, last_completed) {
        (None, _) => format!("has started no collective on comm {}", mine.comm),
        (_, Some(done)) if done >= mine.seq => format!("has completed #{} already", mine.seq),
        (Some(started), done) if done != Some(started) => {
            // It failed (or gave up) before this rank asked: what it had called is what it
            // said at an earlier inquiry.
            let (called, why) = match reply.seen.iter().rfind(|c| c.seq == started) {
                Some(c) => (describe_call(c), differs(c)),
                None => (format!("#{started}"), String::new()),
            };
            format!(
                "last started {called}, which did not complete, and is in no collective now (it failed or was cancelled){why}"
            )
        }
        (_, Some(done)) => format!("last completed #{done} and has started nothing since"),
        (Some(_), None) => format!("has completed no collective on comm {}", mine.comm),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn active(seq: u64, kind: u8, root: Option<u32>, waiting_on: Option<u32>) -> ActiveColl {
        ActiveColl { seq, kind, dtype: DType::F32.to_wire(), root, count: 1 << 20, waited_ms: 0, waiting_on }
    }

    #[test]
    fn the_report_names_the_disagreeing_the_silent_and_the_dead() {
        let mine = StalledOp {
            comm: 0,
            seq: 1234,
            kind: 1,
            dtype: DType::F32,
            count: 1 << 20,
            root: None,
            waited: Duration::from_secs(30),
            waiting_for: 3,
        };
        let position = |active, started, completed| Answer::Position {
            active,
            last_started: Some(started),
            last_completed: Some(completed),
        };
        let replies = vec![
            reply(1, position(vec![active(1234, 1, None, Some(0))], 1234, 1233)),
            reply(2, position(vec![active(1234, 2, Some(0), None)], 1234, 1233)),
            reply(3, position(vec![], 1233, 1233)),
            reply(4, position(vec![active(1234, 1, None, None)], 1234, 1233)),
            reply(5, Answer::Unresponsive),
            reply(6, Answer::Dead("connection lost".into())),
        ];
        let report = stall_report(&mine, &replies);
        assert_eq!(
            report,
            "all_reduce #1234 on comm 0 (4 MiB f32) has waited 30 s for rank 3: \
             rank 3 last completed #1233 and has started nothing since; \
             ranks 1 and 4 are in all_reduce #1234 too; \
             rank 2 is in broadcast #1234 (root 0) — the ranks called different collectives; \
             rank 5 is unresponsive: it did not answer the stall inspector; \
             rank 6 is dead (connection lost)"
        );
    }

    fn reply(rank: usize, answer: Answer) -> Reply {
        Reply { rank, answer, seen: Vec::new() }
    }

    /// Every rank of the stall timed out at once, and this one asked last: ranks 1 and 2 had
    /// already failed (they are in no collective now), rank 3 is silent and rank 4 dead. What
    /// each was seen calling at the warning's inquiry is still named, with how it differs.
    #[test]
    fn the_report_names_what_members_that_failed_first_were_last_seen_calling() {
        let mine = StalledOp {
            comm: 0,
            seq: 1,
            kind: 1,
            dtype: DType::F32,
            count: 1024,
            root: None,
            waited: Duration::from_secs(6),
            waiting_for: 5,
        };
        let failed = Answer::Position { active: vec![], last_started: Some(1), last_completed: Some(0) };
        let seen = |kind, root, count| ActiveColl { count, ..active(1, kind, root, None) };
        let replies = vec![
            Reply { rank: 1, answer: failed.clone(), seen: vec![seen(1, None, 1024)] },
            Reply { rank: 2, answer: failed.clone(), seen: vec![seen(2, Some(0), 1024)] },
            Reply { rank: 3, answer: Answer::Unresponsive, seen: vec![seen(1, None, 512)] },
            Reply { rank: 4, answer: Answer::Dead("connection lost".into()), seen: vec![seen(1, None, 1024)] },
            reply(5, Answer::Position { active: vec![], last_started: Some(0), last_completed: Some(0) }),
            reply(6, failed),
        ];
        let report = stall_report(&mine, &replies);
        assert_eq!(
            report,
            "all_reduce #1 on comm 0 (4 KiB f32) has waited 6.0 s for rank 5: \
             rank 5 last completed #0 and has started nothing since; \
             rank 1 last started all_reduce #1 of 1024 f32, which did not complete, and is in no collective now \
             (it failed or was cancelled); \
             rank 2 last started broadcast #1 of 1024 f32 (root 0), which did not complete, and is in no \
             collective now (it failed or was cancelled) — the ranks called different collectives; \
             rank 3 is unresponsive: it did not answer the stall inspector, last seen in all_reduce #1 \
             of 512 f32 — it passed 512 elements, this rank 1024; \
             rank 4 is dead (connection lost), last seen in all_reduce #1 of 1024 f32; \
             rank 6 last started #1, which did not complete, and is in no collective now (it failed or was cancelled)"
        );
    }

    #[test]
    fn rank_lists_are_compressed() {
        assert_eq!(ranks(&[3]), "rank 3");
        assert_eq!(ranks(&[0, 1]), "ranks 0 and 1");
        assert_eq!(ranks(&[0, 2]), "ranks 0 and 2");
        assert_eq!(ranks(&[0, 4, 5, 6, 9]), "ranks 0, 4-6 and 9");
        assert_eq!(size(4 << 20), "4 MiB");
        assert_eq!(size(1536), "1.5 KiB");
    }
}
