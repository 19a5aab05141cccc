"""The MTP head's drafts (`_core.MtpDrafter`, CPU) against a torch definition of the head.

transformers has no MTP module for Qwen3.5 (it skips `mtp.*` on load), so the reference is
written here from the head's definition, on transformers' own decoder layer and RMSNorm: an MTP
row at position p reads the target's final hidden state at p (after the model's norm) and the
token at p + 1, `x = fc([norm_emb(embed(token)) | norm_hidden(hidden)])`, one causal
full-attention layer over the rows, `mtp.norm`, and the shared lm_head; draft i + 1 reads draft
i and the head's own normed output. On the demo model, its trained head must reproduce the MTP
accuracy that training recorded on the shipped held-out windows.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ninfer import _core  # noqa: E402

from tiny_models import add_mtp_head, load_reference, make_model  # noqa: E402

REL_TOL = 1e-4
"""As tests/test_model_parity.py: max abs diff over max abs reference."""

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = Path(os.environ.get("NINFER_DEMO_DIR", REPO / "python" / "ninfer" / "demo"))


def _rel_err(got, exp) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(exp)).max() / np.abs(np.asarray(exp)).max())


class TorchMtp:
    """The target model (transformers, f32) and its MTP head built from the checkpoint's tensors."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        self.model = load_reference(path)
        # Qwen3_5ForConditionalGeneration nests the text model in `language_model`.
        self.text = getattr(self.model.model, "language_model", self.model.model)
        config = copy.deepcopy(self.model.config.get_text_config())
        config.layer_types = ["full_attention"]
        config.num_hidden_layers = 1
        config._attn_implementation = "eager"
        tensors = {k[len("mtp."):]: v.float() for k, v in load_file(path / "model.safetensors").items() if k.startswith("mtp.")}
        hidden, eps = config.hidden_size, config.rms_norm_eps

        def rms(name):
            n = Qwen3_5RMSNorm(hidden, eps=eps)
            n.load_state_dict({"weight": tensors[name + ".weight"]})
            return n.eval()

        self.fc = tensors["fc.weight"]
        self.norm_emb, self.norm_hidden, self.norm = rms("pre_fc_norm_embedding"), rms("pre_fc_norm_hidden"), rms("norm")
        self.layer = Qwen3_5DecoderLayer(config, 0).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")})

    @torch.no_grad()
    def target(self, ids):
        """Logits [T, V] and final (normed) hidden states [T, H] of the target."""
        hidden = self.text(input_ids=torch.tensor([ids])).last_hidden_state
        return self.model.lm_head(hidden)[0], hidden[0]

    @torch.no_grad()
    def head(self, hidden, next_tokens):
        """The head over rows at positions 0..T-1: normed outputs [T, H] and logits [T, V]."""
        t = len(next_tokens)
        e = self.norm_emb(self.text.embed_tokens(torch.tensor(next_tokens)))
        x = torch.cat([e, self.norm_hidden(hidden)], dim=-1) @ self.fc.T
        positions = torch.arange(t).view(1, 1, -1).expand(3, 1, -1)
        cos_sin = self.text.rotary_emb(x[None], positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], position_embeddings=cos_sin, attention_mask=mask)
        out = self.norm((out[0] if isinstance(out, tuple) else out)[0])
        return out, self.model.lm_head(out)

    def drafts(self, ids, k):
        """Greedy drafts after `ids`: the target runs ids[:-1]; rows (hidden[p], ids[p + 1])."""
        _, hidden = self.target(ids[:-1])
        tokens = list(ids[1:])
        tokens_out, logits_out = [], []
        for _ in range(k):
            out, logits = self.head(hidden, tokens)
            tok = int(logits[-1].argmax())
            tokens_out.append(tok)
            logits_out.append(logits[-1].numpy())
            hidden = torch.cat([hidden, out[-1:]])
            tokens.append(tok)
        return tokens_out, np.stack(logits_out)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return add_mtp_head(make_model(tmp_path_factory.mktemp("mtp") / "qwen3_5", "qwen3_5", seed=3), seed=3)


@pytest.fixture(scope="module")
def mtp_vl_dir(tmp_path_factory):
    """The multimodal layout: decoder under `model.language_model`, config under `text_config`."""
    return add_mtp_head(make_model(tmp_path_factory.mktemp("mtp_vl") / "qwen3_5_vl", "qwen3_5_vl", seed=6), seed=6)


@pytest.fixture(scope="module")
def reference(mtp_dir):
    return TorchMtp(mtp_dir)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(3, 397, size=n)]


def _drafts(drafter, ids, k, chunk=None):
    """The drafter's greedy drafts after `ids` from a fresh sequence (as TorchMtp.drafts)."""
    _, hidden = drafter.target(ids[:-1], chunk=chunk)
    return drafter.draft(hidden, ids[1:], 0, k)


def test_target_hidden_states_are_transformers_last_hidden_state(mtp_dir, reference):
    drafter = _core.MtpDrafter(str(mtp_dir))
    ids = _prompt(70, seed=1)
    logits, hidden = drafter.target(ids)
    ref_logits, ref_hidden = reference.target(ids)
    assert hidden.shape == (70, 72) and logits.shape == (70, 397)
    assert _rel_err(hidden, ref_hidden.numpy()) < REL_TOL
    assert _rel_err(logits, ref_logits.numpy()) < REL_TOL


@pytest.mark.parametrize("n", [1, 2, 19, 40])
def test_three_recursive_drafts_match_the_torch_head(mtp_dir, reference, n):
    drafter = _core.MtpDrafter(str(mtp_dir))
    ids = _prompt(n + 1, seed=n)
    tokens, logits = _drafts(drafter, ids, 3)
    ref_tokens, ref_logits = reference.drafts(ids, 3)
    assert logits.shape == (3, 397)
    for depth in range(3):
        assert _rel_err(logits[depth], ref_logits[depth]) < REL_TOL, depth
    assert tokens == ref_tokens


def test_drafts_of_the_multimodal_layout_match_the_torch_head(mtp_vl_dir):
    drafter = _core.MtpDrafter(str(mtp_vl_dir))
    ids = _prompt(25, seed=11)
    tokens, logits = _drafts(drafter, ids, 3)
    ref_tokens, ref_logits = TorchMtp(mtp_vl_dir).drafts(ids, 3)
    assert tokens == ref_tokens and _rel_err(logits, ref_logits) < REL_TOL


def test_rolling_the_mtp_kv_back_and_redrafting_equals_drafting_fresh(mtp_dir, reference):
    ids = _prompt(30, seed=9)
    rolled = _core.MtpDrafter(str(mtp_dir))
    _, hidden = rolled.target(ids)
    # Draft 5 after ids[:20] (MTP rows written up to position 23), then accept 2 tokens
    # from the target's own: rows 19..21 replace the speculative rows from 19 on.
    first, _ = rolled.draft(hidden[:19], ids[1:20], 0, 5)
    assert len(first) == 5
    tokens, logits = rolled.draft(hidden[19:22], ids[20:23], 19, 3)
    fresh = _core.MtpDrafter(str(mtp_dir))
    fresh_tokens, fresh_logits = _drafts(fresh, ids[:23], 3)
    assert tokens == fresh_tokens
    assert _rel_err(logits, fresh_logits) < 1e-5
    ref_tokens, ref_logits = reference.drafts(ids[:23], 3)
    assert tokens == ref_tokens and _rel_err(logits, ref_logits) < REL_TOL


def test_absorbing_a_chunked_prefill_equals_one_call(mtp_dir):
    ids = _prompt(40, seed=4)
    whole = _core.MtpDrafter(str(mtp_dir))
    tokens, logits = _drafts(whole, ids, 3)
    chunked = _core.MtpDrafter(str(mtp_dir))
    _, hidden = chunked.target(ids[:-1], chunk=16)
    assert chunked.draft(hidden[:16], ids[1:17], 0, 0)[0] == []
    assert chunked.draft(hidden[16:32], ids[17:33], 16, 0)[0] == []
    got_tokens, got_logits = chunked.draft(hidden[32:], ids[33:], 32, 3)
    assert got_tokens == tokens and _rel_err(got_logits, logits) < 1e-5


def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path):
    plain = make_model(tmp_path / "plain", "qwen3_5", seed=2)
    with pytest.raises(Exception, match=r"--spec mtp needs the model's mtp\.\* weights; this checkpoint has none"):
        _core.MtpDrafter(str(plain))


def test_bad_rows_are_refused(mtp_dir):
    drafter = _core.MtpDrafter(str(mtp_dir), max_tokens=32)
    _, hidden = drafter.target(_prompt(10, seed=5))
    with pytest.raises(Exception, match="hidden"):
        drafter.draft(hidden[:3], [5, 6], 0, 1)
    with pytest.raises(Exception, match="block_table"):
        drafter.draft(hidden, _prompt(10, seed=6), 25, 3)


@pytest.mark.skipif(not (DEMO_DIR / "model" / "config.json").exists(), reason="demo model not trained yet")
def test_demo_head_reproduces_the_mtp_accuracy_training_recorded():
    """Training scored the head on the shipped held-out windows, every row conditioned on the
    data (hidden state at p, data token p + 1): its top-1 against data token p + 2 and against
    the target's own argmax at p + 1 (what greedy speculation accepts). The drafter, one row
    per call continuing its MTP KV, must give the same fractions (float32 logits, as training
    measured)."""
    record = json.loads((REPO / "tools" / "demo" / "training_record.json").read_text())["heldout_shipped"]
    windows = json.loads((DEMO_DIR / "heldout_tokens.json").read_text())["sequences"]
    drafter = _core.MtpDrafter(str(DEMO_DIR / "model"), logits_dtype="float32")
    vs_data = agree = scored = 0
    for ids in windows:
        logits, hidden = drafter.target(ids)
        main = logits.argmax(-1)
        for p in range(len(ids) - 2):
            (tok,), _ = drafter.draft(hidden[p:p + 1], ids[p + 1:p + 2], p, 1)
            vs_data += tok == ids[p + 2]
            agree += tok == main[p + 1]
            scored += 1
    assert scored == record["mtp_positions_scored"]
    assert vs_data / scored == pytest.approx(record["mtp_top1_accuracy_vs_data"], abs=2e-3)
    assert agree / scored == pytest.approx(record["mtp_top1_agreement_with_main_greedy"], abs=2e-3)
