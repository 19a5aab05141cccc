//! `NgramDrafter`: prompt lookup. The longest suffix of the request's tokens (up to `max_n`,
//! down to `min_n`) that occurred earlier proposes the tokens that followed its latest earlier
//! occurrence. Code and structured output repeat their own text, which is where this pays.

use super::Drafter;

/// Drafts from the request's own prompt and output.
#[derive(Clone, Copy, Debug)]
pub struct NgramDrafter {
    /// Longest suffix tried first.
    pub max_n: usize,
    /// Shortest suffix that may still propose.
    pub min_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { max_n: 3, min_n: 1 }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let len = tokens.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n.max(1)..=self.max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // Latest earlier occurrence: its continuation is the most recent context.
            if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
                let from = start + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_matching_suffix_proposes_what_followed_it() {
        let d = NgramDrafter::default();
        // Suffix [1, 2, 3] occurred at 0; [2, 3] alone also at 5, but the 3-gram wins.
        let t = [1, 2, 3, 4, 5, 2, 3, 9, 1, 2, 3];
        assert_eq!(d.propose(&t, 2), vec![4, 5]);
        // Only the 1-gram 7 matches: its latest earlier occurrence continues with 8.
        assert_eq!(d.propose(&[7, 6, 7, 8, 0, 7], 3), vec![8, 0, 7]);
    }

    #[test]
    fn no_match_or_no_room_proposes_nothing_and_k_caps_the_draft() {
        let d = NgramDrafter::default();
        assert!(d.propose(&[1, 2, 3], 4).is_empty());
        assert!(d.propose(&[5], 4).is_empty());
        assert!(d.propose(&[1, 2, 1, 2], 0).is_empty());
        assert_eq!(d.propose(&[1, 2, 3, 1, 2], 1), vec![3]);
        // The continuation runs up to the end of the tokens, never past.
        assert_eq!(d.propose(&[4, 4], 5), vec![4]);
    }
}
