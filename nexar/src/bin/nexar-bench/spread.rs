//! The spread of per-iteration times: what `-I` prints beside the median, so that a run whose
//! typical iteration is fast but whose tail is not (a busy machine, a scheduler that parks the
//! wrong thread) shows it.

/// Percentiles and the share of outliers of one size's iterations.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spread {
    /// Median, in microseconds.
    pub p50: f64,
    /// 99th percentile (nearest rank), in microseconds.
    pub p99: f64,
    /// Largest iteration, in microseconds.
    pub max: f64,
    /// Share of iterations that took more than ten times the median, 0 to 1.
    pub over_10x: f64,
}

impl Spread {
    /// The spread of `times` (microseconds, any order); all zero for no times.
    pub fn of(times: &[f64]) -> Spread {
        if times.is_empty() {
            return Spread::default();
        }
        let mut sorted = times.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| sorted[(((sorted.len() as f64) * q).ceil() as usize).clamp(1, sorted.len()) - 1];
        let p50 = sorted[sorted.len() / 2];
        let slow = sorted.iter().filter(|t| **t > 10.0 * p50).count();
        Spread { p50, p99: at(0.99), max: sorted[sorted.len() - 1], over_10x: slow as f64 / sorted.len() as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn percentiles_and_outliers() {
        let mut times: Vec<f64> = (1..=100).map(f64::from).collect();
        times[0] = 10_000.0; // one iteration far above ten times the median
        let s = Spread::of(&times);
        assert_eq!(s.p50, 52.0);
        assert_eq!(s.p99, 100.0);
        assert_eq!(s.max, 10_000.0);
        assert!((s.over_10x - 0.01).abs() < 1e-12);
        assert_eq!(Spread::of(&[]), Spread::default());
        assert_eq!(Spread::of(&[3.0]).p99, 3.0);
    }
}
