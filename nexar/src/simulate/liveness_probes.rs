//! The liveness model's probes of a suspect, step by step as `comm/membership/probe.rs` runs
//! them: a ping, the helpers, rounds repeated with a longer window, the suspect told and given
//! until it has been silent for the heartbeat timeout, and the verdict reported.

use rand::seq::IndexedRandom;

use super::{
    Ev, HelperPing, INDIRECT, MAX_PROBING, MAX_STARVED_ROUNDS, Model, Msg, PROBE_WINDOW, Phase, Probe, micros, watched,
    watchers,
};

impl Model<'_> {
    pub(super) fn investigate(&mut self, now: u64, r: usize, target: usize, reported: bool) {
        let rank = &self.ranks[r];
        if target == r || target >= self.ranks.len() || rank.dead.contains(&target) || rank.probes.contains_key(&target)
        {
            return;
        }
        let probe = Probe {
            reported,
            began: now,
            round_began: now,
            window: self.window,
            starved: 0,
            heard_before: 0,
            round: 0,
            phase: Phase::Ping { nonce: 0 },
        };
        self.ranks[r].probes.insert(target, probe);
        self.start_round(now, r, target);
    }

    pub(super) fn start_round(&mut self, now: u64, r: usize, target: usize) {
        self.nonce += 1;
        self.round += 1;
        let (nonce, round) = (self.nonce, self.round);
        let heard = self.heard(r, target);
        let Some(p) = self.ranks[r].probes.get_mut(&target) else { return };
        p.round_began = now;
        p.heard_before = heard;
        p.round = round;
        p.phase = Phase::Ping { nonce };
        let half = p.window / 2;
        self.send(now, r, target, Msg::Ping { nonce });
        self.queue.push(now + half, Ev::RoundDeadline { rank: r, target, round });
    }

    pub(super) fn pong(&mut self, now: u64, r: usize, from: usize, nonce: u64) {
        if let Some(Probe { phase: Phase::Ping { nonce: n }, .. }) = self.ranks[r].probes.get(&from)
            && *n == nonce
        {
            self.ranks[r].probes.remove(&from);
            return;
        }
        let helping: Vec<u64> =
            self.ranks[r].helping.iter().filter(|(n, h)| **n == nonce && h.target == from).map(|(n, _)| *n).collect();
        for n in helping {
            if let Some(h) = self.ranks[r].helping.remove(&n) {
                self.send(now, r, h.asker, Msg::ProbeResult { nonce: h.asker_nonce, alive: true });
            }
        }
    }

    pub(super) fn round_deadline(&mut self, now: u64, r: usize, target: usize, round: u64) {
        let Some(p) = self.ranks[r].probes.get(&target) else { return };
        if p.round != round {
            return;
        }
        match p.phase.clone() {
            Phase::Ping { .. } => self.ask_helpers(now, r, target),
            Phase::Indirect { asked, answered, .. } => self.end_round(now, r, target, asked, answered),
            Phase::Refute { .. } => self.declare_dead(now, r, target),
        }
    }

    pub(super) fn ask_helpers(&mut self, now: u64, r: usize, target: usize) {
        let live: Vec<usize> =
            (0..self.ranks.len()).filter(|&p| p != r && p != target && !self.ranks[r].dead.contains(&p)).collect();
        let mut asked: Vec<usize> = live.choose_multiple(&mut self.rng, INDIRECT).copied().collect();
        asked.sort_unstable();
        let window = self.ranks[r].probes[&target].window;
        let mut nonces = Vec::new();
        for &h in &asked {
            self.nonce += 1;
            nonces.push(self.nonce);
            self.send(now, r, h, Msg::ProbeFor { nonce: self.nonce, target, within: window / 4 });
        }
        let Some(p) = self.ranks[r].probes.get_mut(&target) else { return };
        p.phase = Phase::Indirect { asked, answered: Vec::new(), nonces };
        let round = p.round;
        self.queue.push(now + window / 2, Ev::RoundDeadline { rank: r, target, round });
    }

    pub(super) fn answer_probe(&mut self, now: u64, h: usize, asker: usize, nonce: u64, target: usize, within: u64) {
        if self.ranks[h].helping.len() >= MAX_PROBING {
            return;
        }
        let fresh = 2 * self.interval;
        let heard = self.ranks[h].heard.contains_key(&target) && self.silent_for(now, h, target) < fresh;
        let alive = if target == h {
            Some(true)
        } else if target >= self.ranks.len() || self.ranks[h].dead.contains(&target) {
            Some(false)
        } else if heard {
            Some(true)
        } else {
            None
        };
        match alive {
            Some(alive) => self.send(now, h, asker, Msg::ProbeResult { nonce, alive }),
            None => {
                self.nonce += 1;
                let ping = self.nonce;
                self.ranks[h].helping.insert(ping, HelperPing { asker, asker_nonce: nonce, target });
                self.send(now, h, target, Msg::Ping { nonce: ping });
                let within = within.min(micros(PROBE_WINDOW));
                self.queue.push(now + within, Ev::HelperDeadline { rank: h, nonce: ping });
            }
        }
    }

    pub(super) fn probe_result(&mut self, now: u64, r: usize, from: usize, nonce: u64, alive: bool) {
        let target = self.ranks[r].probes.iter().find_map(|(t, p)| match &p.phase {
            Phase::Indirect { nonces, asked, .. } if nonces.contains(&nonce) && asked.contains(&from) => Some(*t),
            _ => None,
        });
        let Some(target) = target else { return };
        if alive {
            self.ranks[r].probes.remove(&target);
            return;
        }
        let Some(p) = self.ranks[r].probes.get_mut(&target) else { return };
        if let Phase::Indirect { asked, answered, .. } = &mut p.phase {
            answered.push(from);
            if answered.len() == asked.len() {
                let (asked, answered) = (asked.clone(), answered.clone());
                self.end_round(now, r, target, asked, answered);
            }
        }
    }

    /// The end of a round with no sign of life: as `investigate`'s loop in probe.rs.
    pub(super) fn end_round(&mut self, now: u64, r: usize, target: usize, asked: Vec<usize>, answered: Vec<usize>) {
        let heard = self.heard(r, target);
        let Some(p) = self.ranks[r].probes.get(&target).cloned() else { return };
        if heard > p.heard_before {
            self.ranks[r].probes.remove(&target);
            return;
        }
        let took = now - p.round_began;
        let spent = now - p.began;
        let most_answered = answered.len() * 2 > asked.len();
        let inconclusive = took > 2 * p.window || (!asked.is_empty() && !most_answered);
        if !inconclusive {
            return self.await_refutation(now, r, target);
        }
        let Some(probe) = self.ranks[r].probes.get_mut(&target) else { return };
        if took > 2 * p.window {
            probe.starved += 1;
            if probe.starved >= MAX_STARVED_ROUNDS {
                self.ranks[r].probes.remove(&target);
                return;
            }
        } else if spent + 2 * p.window <= self.timeout {
            probe.window *= 2;
        } else {
            let quiet = self.timeout / 2;
            let beating: Vec<usize> = self.ranks[r].watched.iter().copied().filter(|&w| w != target).collect();
            let cut_off = !beating.is_empty() && beating.iter().all(|&w| self.silent_for(now, r, w) > quiet);
            if cut_off {
                return self.await_refutation(now, r, target);
            }
            self.ranks[r].probes.remove(&target);
            return;
        }
        self.start_round(now, r, target);
    }

    pub(super) fn await_refutation(&mut self, now: u64, r: usize, target: usize) {
        self.send(now, r, target, Msg::Suspect { rank: target });
        let left = self.timeout.saturating_sub(self.silent_for(now, r, target));
        let until = now + left.max(self.window / 2);
        self.round += 1;
        let (round, heard_at) = (self.round, self.heard(r, target));
        let Some(p) = self.ranks[r].probes.get_mut(&target) else { return };
        p.round = round;
        p.phase = Phase::Refute { heard_at };
        self.queue.push(until, Ev::RoundDeadline { rank: r, target, round });
    }

    pub(super) fn declare_dead(&mut self, now: u64, r: usize, target: usize) {
        let reported = self.ranks[r].probes.remove(&target).is_some_and(|p| p.reported);
        if !self.ranks[r].dead.insert(target) {
            return;
        }
        match self.killed {
            Some((k, _)) if k == target => self.declared.push(now),
            _ => self.false_deaths += 1,
        }
        let live: Vec<usize> = (0..self.ranks.len()).filter(|p| !self.ranks[r].dead.contains(p)).collect();
        self.ranks[r].watched = watched(r, &live);
        self.ranks[r].watchers = watchers(r, &live);
        if reported {
            return;
        }
        for p in live {
            if p != r {
                self.send(now, r, p, Msg::Suspect { rank: target });
            }
        }
    }
}
