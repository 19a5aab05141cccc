//! Acceptance of a verified draft, position by position.
//!
//! The target's token at each position is picked exactly as plain decoding would pick it there
//! (the request's sampling row: penalties, logit bias, grammar mask, temperature, one RNG draw)
//! from the logits of that position, given every token accepted before it. The draft token is
//! accepted when the target's token equals it; the first one that differs is the target's own
//! next token and ends the round. For greedy rows this is the longest agreeing prefix plus the
//! target's next token. For sampled rows with a deterministic draft (n-gram) it is the
//! speculative sampling rule: the draft d is accepted with probability p(d), and on rejection
//! the token follows p with d removed and renormalized. Every accepted token used one draw, in
//! order, so a seeded request outputs what it would without speculation. A draft drawn from a
//! distribution q (MTP drafts of sampled requests) is picked by `sampled::speculative_rule`
//! instead, which accepts it exactly when it returns the draft token.

use crate::Result;

/// What one verified draft gave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accepted {
    /// Draft tokens accepted (their KV and state were computed by the verify forward).
    pub drafts: usize,
    /// Tokens output: the accepted drafts, then the target's token when the request did not end
    /// on a draft.
    pub tokens: Vec<u32>,
    /// The request ended on the last of `tokens`.
    pub finished: bool,
}

/// Walk `draft` after a verify forward: `pick(j)` picks and accepts into the request the
/// target's token at position j (0: after the input token), returning it and whether the
/// request ended with it.
pub fn accept_draft(draft: &[u32], mut pick: impl FnMut(usize) -> Result<(u32, bool)>) -> Result<Accepted> {
    let mut out = Accepted::default();
    for j in 0..=draft.len() {
        let (token, finished) = pick(j)?;
        out.tokens.push(token);
        let matches = draft.get(j) == Some(&token);
        if matches {
            out.drafts += 1;
        }
        if finished {
            out.finished = true;
            break;
        }
        if !matches {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(draft: &[u32], target: &[u32], end_at: Option<usize>) -> Accepted {
        accept_draft(draft, |j| Ok((target[j], end_at == Some(j)))).unwrap()
    }

    #[test]
    fn the_longest_agreeing_prefix_and_the_targets_next_token_are_accepted() {
        assert_eq!(run(&[5, 6, 7], &[5, 6, 9, 1], None), Accepted { drafts: 2, tokens: vec![5, 6, 9], finished: false });
        assert_eq!(run(&[5, 6, 7], &[4, 6, 7, 1], None), Accepted { drafts: 0, tokens: vec![4], finished: false });
        // All agree: the bonus token after the last draft comes too.
        assert_eq!(run(&[5, 6], &[5, 6, 8], None), Accepted { drafts: 2, tokens: vec![5, 6, 8], finished: false });
        assert_eq!(run(&[], &[3], None), Accepted { drafts: 0, tokens: vec![3], finished: false });
    }

    #[test]
    fn a_request_that_ends_inside_the_draft_takes_nothing_after_it() {
        // EOS (or a stop, or max_tokens) on the second accepted draft token.
        assert_eq!(run(&[5, 6, 7], &[5, 6, 7, 1], Some(1)), Accepted { drafts: 2, tokens: vec![5, 6], finished: true });
        assert_eq!(run(&[5, 6], &[9, 6, 1], Some(0)), Accepted { drafts: 0, tokens: vec![9], finished: true });
    }
}
