//! The host layout of padded steps (decode and uniform verify steps, which CUDA graphs replay)
//! against the layout of the same step run exactly as it is.

use super::*;

fn chunk(tokens: &[u32], start_pos: usize, block_table: &[u32], state_slot: usize) -> crate::model::runner::SeqChunk {
    crate::model::runner::SeqChunk { tokens: tokens.to_vec(), start_pos, block_table: block_table.to_vec(), state_slot, logits: LogitsWanted::All }
}

fn padded(batch: &StepBatch, shape: PaddedShape, bs: usize, spare: usize) -> (Vec<i32>, Vec<i64>, Sections) {
    let (mut h, mut l) = (Vec::new(), Vec::new());
    let sec = padded_layout(&mut h, &mut l, batch, shape, bs, spare);
    (h, l, sec)
}

#[test]
fn a_verify_step_without_padding_has_the_layout_of_the_step_run_as_it_is() {
    // Two sequences of K + 1 = 3 tokens at positions 5.. and 14.. (block size 4).
    let batch = StepBatch { seqs: vec![chunk(&[7, 8, 9], 5, &[3, 1], 2), chunk(&[4, 5, 6], 14, &[0, 6, 2, 9, 5], 0)] };
    let (mut h, mut l) = (Vec::new(), Vec::new());
    let sec = step_layout(&mut h, &mut l, &batch, 4);
    assert_eq!(sec.max_blocks, 5);
    let got = padded(&batch, PaddedShape { seqs: 2, rows_per_seq: 3, stride: 5 }, 4, 11);
    assert_eq!(got, (h, l, sec));
}

#[test]
fn padding_sequences_of_a_verify_step_come_last_write_no_kv_and_run_on_the_spare_slot() {
    let batch = StepBatch { seqs: vec![chunk(&[7, 8, 9], 5, &[3, 1], 2)] };
    let (h, l, sec) = padded(&batch, PaddedShape { seqs: 2, rows_per_seq: 3, stride: 4 }, 4, 11);
    assert_eq!(sec, Sections { tokens: 6, seqs: 2, max_blocks: 4, max_context: 8 });
    #[rustfmt::skip]
    let want: Vec<i32> = [
        &[7, 8, 9, 0, 0, 0][..],       // ids
        &[5, 6, 7, 0, 1, 2],           // positions: the padding sequence's 0..K + 1
        &[0, 0, 0, 1, 1, 1],           // token_seq
        &[0, 3, 6],                    // cu_seqlens
        &[2, 11],                      // slots
        &[3, 1, 0, 0, 0, 0, 0, 0],     // block tables, 4 columns
    ].concat();
    assert_eq!(h, want);
    // Positions 5, 6, 7 are offsets 1, 2, 3 of block 1 (the table's second entry).
    assert_eq!(l, vec![5, 6, 7, -1, -1, -1]);
}

#[test]
fn a_padded_decode_step_is_the_one_row_a_sequence_case() {
    let batch = StepBatch { seqs: vec![chunk(&[42], 9, &[4, 2, 8], 1), chunk(&[43], 3, &[5], 0)] };
    let (h, l, sec) = padded(&batch, PaddedShape { seqs: 4, rows_per_seq: 1, stride: 3 }, 4, 6);
    assert_eq!(sec, Sections { tokens: 4, seqs: 4, max_blocks: 3, max_context: 10 });
    #[rustfmt::skip]
    let want: Vec<i32> = [
        &[42, 43, 0, 0][..], &[9, 3, 0, 0], &[0, 1, 2, 3], &[0, 1, 2, 3, 4], &[1, 0, 6, 6],
        &[4, 2, 8, 5, 0, 0, 0, 0, 0, 0, 0, 0],
    ].concat();
    assert_eq!(h, want);
    assert_eq!(l, vec![8 * 4 + 1, 5 * 4 + 3, -1, -1]);
}

#[test]
fn tables_longer_than_the_stride_are_cut_and_shorter_ones_zero_padded() {
    // A table may cover more blocks than the step reaches (the engine allocates ahead).
    let batch = StepBatch { seqs: vec![chunk(&[1, 2], 2, &[9, 8, 7, 6, 5], 0), chunk(&[3, 4], 0, &[4], 1)] };
    let (h, _, sec) = padded(&batch, PaddedShape { seqs: 2, rows_per_seq: 2, stride: 2 }, 4, 2);
    let tables = &h[3 * sec.tokens + 2 * sec.seqs + 1..];
    assert_eq!(tables, &[9, 8, 4, 0]);
}
