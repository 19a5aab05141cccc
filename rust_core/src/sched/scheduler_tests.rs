//! `Scheduler` unit tests: the bookkeeping of steps, loans and lookaheads.

use super::*;

fn scheduler(blocks: usize, max_concurrency: usize) -> Scheduler {
    let cfg = SchedulerConfig { max_concurrency, prefill_chunk: 64, prefix_reuse: false, key_next_token: false };
    Scheduler::new(cfg, BlockPool::new(blocks, 4), StateSlots::none())
}

/// `schedule` and its bookkeeping, as the engine runs a step whose tokens are still in flight
/// (not appended yet).
fn launch(s: &mut Scheduler) -> ScheduledStep {
    let step = s.schedule();
    s.on_step_launched(&step);
    step
}

fn settle(s: &mut Scheduler, step: &ScheduledStep) {
    for &id in &step.seq_ids {
        s.append_token(id, 7);
    }
}

#[test]
fn update_from_output_appends_each_token_and_frees_the_ended_sequences() {
    let mut s = scheduler(16, 4);
    s.add(Sequence::new(0, vec![1; 3]));
    s.add(Sequence::new(1, vec![2; 4]));
    launch(&mut s);
    assert_eq!(s.used_blocks(), 2);
    let outcomes = [SeqOutcome { id: 0, token: 9, finished: false, computed: false }, SeqOutcome { id: 1, token: 8, finished: true, computed: false }];
    assert!(s.update_from_output(&outcomes, None).is_empty(), "no state slots, no snapshots");
    assert_eq!(s.get(0).unwrap().output(), &[9]);
    assert!(s.get(1).is_none());
    assert_eq!((s.num_running(), s.used_blocks()), (1, 1));
}

#[test]
fn a_loan_holds_its_blocks_and_slot_until_given_back() {
    let cfg = SchedulerConfig { max_concurrency: 2, prefill_chunk: 64, prefix_reuse: false, key_next_token: false };
    let mut s = Scheduler::new(cfg, BlockPool::new(4, 4), StateSlots::new(1, 0));
    let loan = s.lend(3).expect("3 of 4 blocks free");
    assert_eq!((loan.block_table.len(), loan.state_slot.is_some(), s.free_blocks()), (3, true, 1));
    assert!(s.lend(2).is_none(), "too few blocks left");
    let slotless = s.lend(1).expect("a block is free");
    assert_eq!(slotless.state_slot, None, "the only running slot is lent");
    s.give_back(slotless);
    s.give_back(loan);
    assert_eq!(s.free_blocks(), 4);
    assert!(s.lend(0).expect("nothing asked").state_slot.is_some(), "the slot came back");
}

#[test]
fn the_lookahead_is_the_decode_step_after_the_step_in_flight() {
    let mut s = scheduler(16, 4);
    s.add(Sequence::new(0, vec![1; 3]));
    s.add(Sequence::new(1, vec![2; 4]));
    let prompts = launch(&mut s);
    assert!(s.schedule_lookahead(&prompts).is_none(), "a prompt step is not followed ahead");
    settle(&mut s, &prompts);
    let decode = launch(&mut s);
    let ahead = s.schedule_lookahead(&decode).expect("all decodes of every running sequence");
    assert_eq!((ahead.seq_ids.clone(), ahead.num_decodes), (vec![0, 1], 2));
    let starts: Vec<usize> = ahead.batch.seqs.iter().map(|q| q.start_pos).collect();
    let tables: Vec<usize> = ahead.batch.seqs.iter().map(|q| q.block_table.len()).collect();
    // Sequence 0 reaches position 4, the first of a new block; sequence 1 position 5.
    assert_eq!((starts, tables), (vec![4, 5], vec![2, 2]));
    assert!(ahead.batch.seqs.iter().all(|q| q.tokens == vec![0] && q.logits == LogitsWanted::Last));
}

/// A scheduler whose sequence 0 (a 3-token prompt) has its first decode step in flight.
fn first_decode_in_flight(blocks: usize, max_concurrency: usize) -> (Scheduler, ScheduledStep) {
    let mut s = scheduler(blocks, max_concurrency);
    s.add(Sequence::new(0, vec![1; 3]));
    let prompt = launch(&mut s);
    settle(&mut s, &prompt);
    let decode = launch(&mut s);
    (s, decode)
}

#[test]
fn no_lookahead_while_someone_could_be_admitted_or_blocks_would_run_out() {
    let (mut s, decode) = first_decode_in_flight(16, 2);
    s.add(Sequence::new(1, vec![2; 5]));
    assert!(s.schedule_lookahead(&decode).is_none(), "sequence 1 waits while the concurrency has room");
    // Full concurrency: the waiting one could not be admitted anyway.
    let (mut s, decode) = first_decode_in_flight(16, 1);
    s.add(Sequence::new(1, vec![2; 5]));
    assert!(s.schedule_lookahead(&decode).is_some());
    // Position 4 needs a new block and none is free: nothing changes.
    let (mut s, decode) = first_decode_in_flight(1, 1);
    assert_eq!(s.pool.num_free(), 0);
    assert!(s.schedule_lookahead(&decode).is_none());
    assert_eq!(s.get(0).unwrap().block_table.len(), 1);
}

/// A verify chunk counts only its input token at launch; the accepted drafts count once the
/// outcome says so, only their full blocks are hashed, and blocks that held only rejected
/// draft tokens go back to the pool.
#[test]
fn a_verify_chunk_counts_only_its_accepted_drafts_and_frees_the_rest() {
    let cfg = SchedulerConfig { max_concurrency: 2, prefill_chunk: 64, prefix_reuse: true, key_next_token: false };
    let mut s = Scheduler::new(cfg, BlockPool::new(16, 4), StateSlots::none());
    s.add(Sequence::new(0, vec![1, 2, 3]));
    let prompt = launch(&mut s);
    settle(&mut s, &prompt);
    s.set_drafts(|_| vec![4, 5, 6, 8, 9]);
    let verify = launch(&mut s);
    assert_eq!((verify.draft_len(0), verify.num_draft_tokens(), verify.num_decodes), (5, 5, 1));
    let chunk = &verify.batch.seqs[0];
    assert_eq!((chunk.tokens.clone(), chunk.start_pos, chunk.block_table.len(), chunk.logits), (vec![7, 4, 5, 6, 8, 9], 3, 3, LogitsWanted::All));
    assert_eq!((s.get(0).unwrap().num_computed, s.used_blocks()), (4, 3));
    // Drafts 4 and 5 accepted, then the target's own 1.
    let outcomes = [
        SeqOutcome { id: 0, token: 4, finished: false, computed: true },
        SeqOutcome { id: 0, token: 5, finished: false, computed: true },
        SeqOutcome { id: 0, token: 1, finished: false, computed: false },
    ];
    assert!(s.update_from_output(&outcomes, None).is_empty());
    let seq = s.get(0).unwrap();
    assert_eq!((seq.tokens.clone(), seq.num_computed, seq.num_registered_blocks), (vec![1, 2, 3, 7, 4, 5, 1], 6, 1));
    assert!(seq.draft.is_empty());
    assert_eq!(s.used_blocks(), 2, "the block of positions 8.. held only rejected drafts");
}

/// Draft blocks never take the block a later decode of the same step needs.
#[test]
fn a_draft_is_cut_where_free_blocks_run_out_for_later_decodes() {
    let mut s = scheduler(3, 2);
    s.add(Sequence::new(0, vec![1; 3]));
    s.add(Sequence::new(1, vec![2; 3]));
    let prompts = launch(&mut s);
    settle(&mut s, &prompts);
    // Both decode at position 3 (their first block); a draft needs a block from position 4 on
    // and one block is free: sequence 0 leaves it for the decode after it, sequence 1, the last
    // decode of the step, may take it.
    s.set_drafts(|_| vec![3, 3, 3]);
    let step = launch(&mut s);
    assert_eq!((step.draft_len(0), step.draft_len(1)), (0, 3));
    assert_eq!((step.seq_ids.clone(), s.num_preemptions(), s.free_blocks()), (vec![0, 1], 0, 0));
}
