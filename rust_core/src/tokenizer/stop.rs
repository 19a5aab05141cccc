//! Stop strings that may span token boundaries.
//!
//! Text arrives as deltas. Any tail of the text so far that could be the start of a stop string
//! is held back; when a stop string completes, the text is cut before it and generation ends.
//! The stop string itself is never returned (OpenAI semantics).

/// Outcome of feeding one delta.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is safe to emit now.
    pub text: String,
    /// The stop string that matched, if any (generation must end).
    pub matched: Option<String>,
}

/// Stop-string matcher of one sequence.
#[derive(Clone, Debug, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    held: String,
}

impl StopChecker {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        StopChecker { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new() }
    }

    /// Feed a delta of text.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome { text: delta.to_string(), matched: None };
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(delta);
        let first = self.stops.iter().filter_map(|s| buf.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at);
        if let Some((at, s)) = first {
            buf.truncate(at);
            return StopOutcome { text: buf, matched: Some(s.clone()) };
        }
        let keep = self.longest_partial_suffix(&buf);
        self.held = buf.split_off(buf.len() - keep);
        StopOutcome { text: buf, matched: None }
    }

    /// The held-back text, released when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `buf` that is a proper prefix of a stop string.
    fn longest_partial_suffix(&self, buf: &str) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for (i, _) in buf.char_indices().rev().take(s.chars().count()) {
                let tail = &buf[i..];
                if tail.len() > best && tail.len() < s.len() && s.starts_with(tail) {
                    best = tail.len();
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], deltas: &[&str]) -> (String, Option<String>) {
        let mut c = StopChecker::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        for d in deltas {
            let o = c.push(d);
            out.push_str(&o.text);
            if o.matched.is_some() {
                return (out, o.matched);
            }
        }
        out.push_str(&c.flush());
        (out, None)
    }

    #[test]
    fn stop_string_split_over_deltas_is_cut_with_the_text_before_it_kept() {
        assert_eq!(feed(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), Some("END".into())));
    }

    #[test]
    fn partial_match_that_fails_is_released_unchanged() {
        assert_eq!(feed(&["END"], &["a E", "Nx", "y"]), ("a ENxy".into(), None));
    }

    #[test]
    fn held_back_text_is_never_emitted_before_it_is_known_safe() {
        let mut c = StopChecker::new(&["</s>".to_string()]);
        assert_eq!(c.push("ok </").text, "ok ");
        assert_eq!(c.flush(), "</");
    }

    #[test]
    fn earliest_of_several_stop_strings_wins_and_multibyte_text_is_safe() {
        assert_eq!(feed(&["b", "éa"], &["xé", "ab"]), ("x".into(), Some("éa".into())));
    }
}
