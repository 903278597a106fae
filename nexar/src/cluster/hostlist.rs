//! SLURM's compressed host lists: `node[001-004,007],gpu-a[1-2]` and the like.
//!
//! A list is a comma-separated sequence of host patterns (commas inside brackets belong to the
//! bracket). A pattern is literal text with any number of bracket groups; each group holds
//! comma-separated numbers and `start-end` ranges. A pattern expands to the cartesian product of
//! its groups, the first group varying slowest, and each number keeps the width of the text it
//! came from (`node[08-11]` gives `node08` … `node11`). Hosts come out in the order written,
//! duplicates included.
//!
//! Parsing never allocates for hosts that are not returned: the number of hosts is computed
//! first and a list of more than [`MAX_HOSTS`] is refused, and [`first`] builds one host only.

/// The most hosts one list may expand to.
///
/// ```
/// use nexar::cluster::hostlist;
/// assert_eq!(hostlist::MAX_HOSTS, 1_000_000);
/// assert!(hostlist::expand("n[1-1000001]").is_err());
/// ```
pub const MAX_HOSTS: u64 = 1_000_000;

/// Why a host list does not parse. Each variant names the text at fault.
///
/// ```
/// use nexar::cluster::hostlist::{self, HostListError};
/// let err = hostlist::expand("node[4-1]").unwrap_err();
/// assert!(matches!(err, HostListError::ReversedRange { .. }));
/// assert!(err.to_string().contains("4-1"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostListError {
    /// The list holds no host at all.
    #[error("the host list is empty")]
    Empty,
    /// A comma with no host name on one side of it.
    #[error("the host list {list:?} has an empty host name (two commas in a row, or one at an end)")]
    EmptyName {
        /// The whole list.
        list: String,
    },
    /// A `[` without its `]`, a `]` without its `[`, or a `[` inside brackets.
    #[error("unbalanced bracket in host pattern {pattern:?}")]
    UnbalancedBracket {
        /// The pattern (or, for a `[` left open, the rest of the list from that pattern on).
        pattern: String,
    },
    /// A range that runs backwards.
    #[error("range {range:?} in host pattern {pattern:?} runs backwards: its start is greater than its end")]
    ReversedRange {
        /// The range as written.
        range: String,
        /// The pattern holding it.
        pattern: String,
    },
    /// Something in brackets that is not a number or a `start-end` range of numbers.
    #[error("{range:?} in host pattern {pattern:?} is not a number or a range of numbers such as 1-4")]
    InvalidRange {
        /// The bracket item as written.
        range: String,
        /// The pattern holding it.
        pattern: String,
    },
    /// The list would expand to more than [`MAX_HOSTS`] hosts.
    #[error("host list {text:?} expands to more than {limit} hosts")]
    TooLarge {
        /// The pattern at fault, or the whole list when only the patterns together are too many.
        text: String,
        /// The limit, [`MAX_HOSTS`].
        limit: u64,
    },
}

/// Expands a host list into its hosts, in the order written.
///
/// ```
/// use nexar::cluster::hostlist::expand;
/// assert_eq!(expand("node[08-10],gpu-a[1-2]b").unwrap(),
///            ["node08", "node09", "node10", "gpu-a1b", "gpu-a2b"]);
/// assert_eq!(expand("rack[1-2]-n[1-2]").unwrap(), ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]);
/// assert!(expand("node[1-").is_err());
/// ```
pub fn expand(list: &str) -> Result<Vec<String>, HostListError> {
    let patterns = parse(list)?;
    // `parse` has bounded the total by MAX_HOSTS, so this allocation is bounded too.
    let total: u64 = patterns.iter().map(Pattern::count).sum();
    let mut hosts = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
    for pattern in &patterns {
        pattern.expand_into(&mut hosts);
    }
    Ok(hosts)
}

/// The first host of a list, without expanding the rest. It fails exactly when [`expand`] would.
///
/// ```
/// use nexar::cluster::hostlist::first;
/// assert_eq!(first("node[007-100],login1").unwrap(), "node007");
/// assert_eq!(first(" n1 , n2 ").unwrap(), "n1");
/// assert!(first("").is_err());
/// ```
pub fn first(list: &str) -> Result<String, HostListError> {
    let patterns = parse(list)?;
    // `parse` returns at least one pattern, and every group holds at least one item.
    Ok(patterns.first().map(Pattern::first).unwrap_or_default())
}

/// One host pattern: literal text and bracket groups in the order written.
#[derive(Debug)]
struct Pattern {
    parts: Vec<Part>,
}

#[derive(Debug)]
enum Part {
    Text(String),
    Group(Vec<Range>),
}

/// `start..=end`, each number printed zero-padded to `width` digits.
#[derive(Clone, Copy, Debug)]
struct Range {
    start: u64,
    end: u64,
    width: usize,
}

impl Range {
    fn count(&self) -> u64 {
        (self.end - self.start).saturating_add(1)
    }
}

impl Pattern {
    /// The number of hosts, saturating (a real count is far below `u64::MAX` once bounded).
    fn count(&self) -> u64 {
        self.parts
            .iter()
            .map(|part| match part {
                Part::Text(_) => 1,
                Part::Group(ranges) => ranges.iter().fold(0u64, |n, r| n.saturating_add(r.count())),
            })
            .fold(1u64, u64::saturating_mul)
    }

    fn first(&self) -> String {
        let mut host = String::new();
        for part in &self.parts {
            match part {
                Part::Text(text) => host.push_str(text),
                Part::Group(ranges) => {
                    let r = ranges[0];
                    host.push_str(&format!("{:0width$}", r.start, width = r.width));
                }
            }
        }
        host
    }

    /// Appends every host of the pattern: a cartesian product, the first group slowest.
    fn expand_into(&self, out: &mut Vec<String>) {
        let mut partial = vec![String::new()];
        for part in &self.parts {
            match part {
                Part::Text(text) => partial.iter_mut().for_each(|h| h.push_str(text)),
                Part::Group(ranges) => {
                    let mut next = Vec::with_capacity(partial.len());
                    for prefix in &partial {
                        for r in ranges {
                            for n in r.start..=r.end {
                                next.push(format!("{prefix}{n:0width$}", width = r.width));
                            }
                        }
                    }
                    partial = next;
                }
            }
        }
        out.append(&mut partial);
    }
}

/// Parses and validates the whole list, and bounds its size, without expanding it.
fn parse(list: &str) -> Result<Vec<Pattern>, HostListError> {
    if list.trim().is_empty() {
        return Err(HostListError::Empty);
    }
    let mut patterns = Vec::new();
    let mut total: u64 = 0;
    for text in split_top_level(list)? {
        let text = text.trim();
        if text.is_empty() {
            return Err(HostListError::EmptyName { list: list.to_string() });
        }
        let pattern = parse_pattern(text)?;
        let count = pattern.count();
        if count > MAX_HOSTS {
            return Err(HostListError::TooLarge { text: text.to_string(), limit: MAX_HOSTS });
        }
        total += count;
        if total > MAX_HOSTS {
            return Err(HostListError::TooLarge { text: list.to_string(), limit: MAX_HOSTS });
        }
        patterns.push(pattern);
    }
    Ok(patterns)
}

/// Splits at the commas outside brackets, checking that brackets pair up and do not nest.
fn split_top_level(list: &str) -> Result<Vec<&str>, HostListError> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut open: Option<usize> = None;
    for (i, c) in list.char_indices() {
        match c {
            '[' if open.is_some() => return Err(unbalanced(pattern_around(list, start, i))),
            '[' => open = Some(i),
            ']' if open.is_none() => return Err(unbalanced(pattern_around(list, start, i))),
            ']' => open = None,
            ',' if open.is_none() => {
                pieces.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if open.is_some() {
        return Err(unbalanced(list[start..].trim()));
    }
    pieces.push(&list[start..]);
    Ok(pieces)
}

/// The pattern that starts at `start` and contains byte `at`: up to the next comma outside
/// brackets, or the end.
fn pattern_around(list: &str, start: usize, at: usize) -> &str {
    let end = list[at..].find(',').map_or(list.len(), |n| at + n);
    list[start..end].trim()
}

fn unbalanced(pattern: &str) -> HostListError {
    HostListError::UnbalancedBracket { pattern: pattern.to_string() }
}

/// Parses one pattern whose brackets are known to pair up without nesting.
fn parse_pattern(pattern: &str) -> Result<Pattern, HostListError> {
    let mut parts = Vec::new();
    let mut rest = pattern;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            parts.push(Part::Text(rest[..open].to_string()));
        }
        let close = open + rest[open..].find(']').ok_or_else(|| unbalanced(pattern))?;
        let group =
            rest[open + 1..close].split(',').map(|item| parse_range(item, pattern)).collect::<Result<_, _>>()?;
        parts.push(Part::Group(group));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_string()));
    }
    Ok(Pattern { parts })
}

/// Parses `7`, `007` or `08-11` (whitespace around it ignored).
fn parse_range(item: &str, pattern: &str) -> Result<Range, HostListError> {
    let item = item.trim();
    let invalid = || HostListError::InvalidRange { range: item.to_string(), pattern: pattern.to_string() };
    let (low, high) = item.split_once('-').unwrap_or((item, item));
    let is_range = item.contains('-');
    let number = |digits: &str| -> Result<u64, HostListError> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        // More digits than a u64 holds: a range that long is certainly over the limit, and a
        // single number that long is no host name anyone uses.
        digits.parse().map_err(|_| {
            if is_range { HostListError::TooLarge { text: pattern.to_string(), limit: MAX_HOSTS } } else { invalid() }
        })
    };
    let (start, end) = (number(low)?, number(high)?);
    if start > end {
        return Err(HostListError::ReversedRange { range: item.to_string(), pattern: pattern.to_string() });
    }
    Ok(Range { start, end, width: low.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list:?} should parse: {e}"))
    }

    #[test]
    fn plain_names() {
        assert_eq!(ok("n1"), ["n1"]);
        assert_eq!(ok("n1,n2"), ["n1", "n2"]);
        assert_eq!(ok("  n1 ,\tn2 , login-3  "), ["n1", "n2", "login-3"]);
    }

    #[test]
    fn ranges_and_singles() {
        assert_eq!(ok("node[1-3]"), ["node1", "node2", "node3"]);
        assert_eq!(ok("x[5]"), ["x5"]);
        assert_eq!(ok("node[001-004,007]"), ["node001", "node002", "node003", "node004", "node007"]);
        assert_eq!(ok("n[1-2, 5 ,7-8]"), ["n1", "n2", "n5", "n7", "n8"]);
        assert_eq!(ok("n[3-3]"), ["n3"]);
        assert_eq!(ok("n[0-1]"), ["n0", "n1"]);
    }

    #[test]
    fn zero_padding_is_kept() {
        assert_eq!(ok("node[08-11]"), ["node08", "node09", "node10", "node11"]);
        assert_eq!(ok("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(ok("n[9-10]"), ["n9", "n10"]);
        assert_eq!(ok("n[007]"), ["n007"]);
        assert_eq!(ok("n[00]"), ["n00"]);
    }

    #[test]
    fn several_patterns() {
        assert_eq!(ok("node[001-002,007],gpu-a[1-2]"), ["node001", "node002", "node007", "gpu-a1", "gpu-a2"]);
        assert_eq!(ok("a,b[1-2],c"), ["a", "b1", "b2", "c"]);
    }

    #[test]
    fn suffixes_after_brackets() {
        assert_eq!(ok("a[1-2]b"), ["a1b", "a2b"]);
        assert_eq!(ok("gpu[1-2].cluster.local"), ["gpu1.cluster.local", "gpu2.cluster.local"]);
        assert_eq!(ok("[1-2]x"), ["1x", "2x"]);
    }

    #[test]
    fn several_groups_in_one_name_form_a_product_in_order() {
        assert_eq!(ok("rack[1-2]-node[01-02]"), ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]);
        assert_eq!(ok("r[1,3]n[5][7-8]x"), ["r1n57x", "r1n58x", "r3n57x", "r3n58x"]);
    }

    #[test]
    fn duplicates_and_order_are_kept() {
        assert_eq!(ok("n[2,1,2]"), ["n2", "n1", "n2"]);
        assert_eq!(ok("b,a,b"), ["b", "a", "b"]);
    }

    #[test]
    fn first_matches_expand() {
        for list in ["n1", "node[08-11]", " rack[2-3]-node[007,1] , x", "a[5]b[6-7]c", "n[2,1]"] {
            assert_eq!(first(list).unwrap(), ok(list)[0], "{list:?}");
        }
    }

    #[test]
    fn first_does_not_need_to_expand_but_validates_everything() {
        // Just under the limit: `first` answers without building a million names.
        assert_eq!(first("big[000001-1000000]").unwrap(), "big000001");
        assert!(matches!(first("n1,n[2-"), Err(HostListError::UnbalancedBracket { .. })));
        assert!(matches!(first("n1,big[1-1000001]"), Err(HostListError::TooLarge { .. })));
        assert_eq!(first(""), Err(HostListError::Empty));
    }

    #[test]
    fn empty_input() {
        assert_eq!(expand(""), Err(HostListError::Empty));
        assert_eq!(expand("  \t"), Err(HostListError::Empty));
    }

    #[test]
    fn empty_names() {
        for list in ["a,,b", "a,", ",a", "a, ,b"] {
            assert_eq!(expand(list), Err(HostListError::EmptyName { list: list.to_string() }), "{list:?}");
        }
    }

    #[test]
    fn unbalanced_brackets_name_the_pattern() {
        let cases = [
            ("node[1-2", "node[1-2"),
            ("a,node[1-2,b", "node[1-2,b"),
            ("node1-2]", "node1-2]"),
            ("ok,node1]x,c", "node1]x"),
            ("n[[1]]", "n[[1]]"),
            ("n[1]]", "n[1]]"),
        ];
        for (list, pattern) in cases {
            assert_eq!(
                expand(list),
                Err(HostListError::UnbalancedBracket { pattern: pattern.to_string() }),
                "{list:?}"
            );
        }
    }

    #[test]
    fn reversed_ranges() {
        assert_eq!(
            expand("a,node[4-1]"),
            Err(HostListError::ReversedRange { range: "4-1".into(), pattern: "node[4-1]".into() })
        );
        assert!(expand("n[10-09]").unwrap_err().to_string().contains("10-09"));
    }

    #[test]
    fn non_digits_in_ranges() {
        for (list, item) in [
            ("n[a-b]", "a-b"),
            ("n[1-x]", "1-x"),
            ("n[]", ""),
            ("n[1,]", ""),
            ("n[-3]", "-3"),
            ("n[3-]", "3-"),
            ("n[1-2-3]", "1-2-3"),
            ("n[+1]", "+1"),
            ("n[1 2]", "1 2"),
            ("n[١]", "١"),
        ] {
            assert_eq!(
                expand(list),
                Err(HostListError::InvalidRange { range: item.to_string(), pattern: list.to_string() }),
                "{list:?}"
            );
        }
    }

    #[test]
    fn error_messages_name_the_text() {
        let msg = expand("gpu[1-z]").unwrap_err().to_string();
        assert!(msg.contains("1-z") && msg.contains("gpu[1-z]"), "{msg}");
        let msg = expand("gpu[1-2").unwrap_err().to_string();
        assert!(msg.contains("gpu[1-2"), "{msg}");
    }

    #[test]
    fn size_limit_is_checked_before_allocating() {
        assert_eq!(ok("n[1-1000000]").len(), 1_000_000);
        let too_many = |text: &str| HostListError::TooLarge { text: text.to_string(), limit: MAX_HOSTS };
        assert_eq!(expand("n[1-1000001]"), Err(too_many("n[1-1000001]")));
        // Would not fit in memory at all if it were allocated first.
        assert_eq!(expand("n[0-18446744073709551615]"), Err(too_many("n[0-18446744073709551615]")));
        assert_eq!(expand("n[0-99999999999999999999999]"), Err(too_many("n[0-99999999999999999999999]")));
        assert_eq!(
            expand("n[99999999999999999999999]"),
            Err(HostListError::InvalidRange {
                range: "99999999999999999999999".into(),
                pattern: "n[99999999999999999999999]".into()
            })
        );
        // A product of groups, each small.
        assert_eq!(expand("a[1-1000]b[1-1001]"), Err(too_many("a[1-1000]b[1-1001]")));
        assert_eq!(
            expand("r[0-99999]n[0-99999]m[0-99999]x[0-99999]"),
            Err(too_many("r[0-99999]n[0-99999]m[0-99999]x[0-99999]"))
        );
        // Several patterns, each allowed, together too many: the whole list is named.
        assert_eq!(expand("a[1-600000],b[1-400001]"), Err(too_many("a[1-600000],b[1-400001]")));
        assert_eq!(ok("a[1-600000],b[1-400000]").len(), 1_000_000);
    }
}
