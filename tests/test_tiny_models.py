"""The shipped tiny models. djax-tiny-v4 (V4): it loads, decodes greedily to a fixed text, and matches HF
transformers on held-out code. djax-tiny (V4.1, the default; HF has no V4.1 class): it loads, decodes
greedily to a fixed text, and its decode path through the state reproduces the full forward on held-out code."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.config import CSA, HCA, SLIDING
from djax.models import deepseek_v4

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from stdlib_corpus import corpus_files, is_heldout  # noqa: E402
from train_tiny import engram_token_map, heldout_windows, nll_sum  # noqa: E402

ASSET = Path(djax.__file__).resolve().parent / "assets" / "djax-tiny-v4"
PROMPT = "class Stack:\n    def __init__(self):\n"
# Generated once from the shipped weights (float32, CPU); every step's top-1 logit leads the runner-up by > 0.39.
EXPECTED = "\nclass Stack:\n    def __init__(self, *args, **kwargs):\n        self.args = args"


def load(asset: Path):
    """(config, params, tokenizer) of a shipped model."""
    from tokenizers import Tokenizer

    config, params = djax.load_checkpoint(asset, progress=False)
    return config, params, Tokenizer.from_file(str(asset / "tokenizer.json"))


def greedy_text(model) -> str:
    """24 greedy tokens after PROMPT, decoded: twice the same, and each the argmax of a teacher-forced forward."""
    config, params, tokenizer = model
    prompt = tokenizer.encode(PROMPT).ids
    runs = [
        djax.generate(params, djax.Batch.from_lists([prompt]), config, max_new_tokens=24).to_lists()[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    # Greedy decoding through the state is the argmax of a teacher-forced forward over the same text.
    seq = prompt + runs[0]
    logits = np.asarray(djax.forward(params, jnp.asarray([seq]), config))[0]
    assert np.argmax(logits[len(prompt) - 1 : -1], -1).tolist() == runs[0]
    return tokenizer.decode(runs[0])


@pytest.fixture(scope="module")
def tiny():
    return load(ASSET)


def test_shipped_files(tiny):
    config, _, tokenizer = tiny
    assert (ASSET / "model.safetensors").stat().st_size <= 25e6
    assert {config.layer_type(i) for i in range(config.num_hidden_layers)} == {SLIDING, CSA, HCA}
    assert config.num_hash_layers > 0 and config.hc_mult > 1 and config.n_routed_experts > 1
    assert tokenizer.get_vocab_size() == config.vocab_size <= 8192
    ids = tokenizer.encode("x = 1").ids
    assert ids[0] == config.bos_token_id and tokenizer.decode(ids) == "x = 1"


def test_greedy_generation_is_deterministic(tiny):
    assert greedy_text(tiny) == EXPECTED


@pytest.fixture(scope="module")
def heldout_logits(tiny):
    """djax's and HF transformers' float32 logits on two 512-token windows of held-out stdlib code."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config, params, tokenizer = tiny
    inputs, targets = heldout_windows(tokenizer, None, 512, max_files=1)
    inputs, targets = inputs[:2], targets[:2]
    ours = np.asarray(jax.jit(lambda p, t: deepseek_v4.forward(p, t, config))(params, inputs))
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor(inputs, dtype=torch.long)).logits.float().numpy()
    return ours, ref, targets


def test_heldout_split_is_fixed_by_file_name():
    held = [name for name, _ in corpus_files(split="heldout")]
    assert held and all(is_heldout(n) for n in held)
    assert not any(is_heldout(n) for n, _ in corpus_files(split="train")[:200])


def test_logits_and_perplexity_match_hf_on_heldout_text(heldout_logits):
    """Both claims in one test of the fixture (two forwards of 1,024 tokens, djax's and HF's): as two tests,
    the suite's two workers often each computed it."""
    ours, ref, targets = heldout_logits
    err = np.abs(ours - ref)[targets >= 0].max()
    assert err <= 1e-4 * np.abs(ref).max(), (err, np.abs(ref).max())
    ppl = [np.exp(np.divide(*nll_sum(x, targets))) for x in (ours, ref)]
    assert abs(ppl[0] / ppl[1] - 1) <= 1e-3, ppl
    assert ppl[0] < 100, ppl  # trained: a uniform guess over 8192 tokens scores 8192


# ---- djax-tiny: DeepSeek-V4.1, the default model -------------------------------------------------------
ASSET_V41 = Path(djax.__file__).resolve().parent / "assets" / "djax-tiny"
# Generated once from the shipped weights (float32, CPU); every step's top-1 logit leads the runner-up by > 0.17.
EXPECTED_V41 = "# Internal -- make sure we don't want to make sure it works.\nclass StackSummary("


@pytest.fixture(scope="module")
def tiny41():
    return load(ASSET_V41)


def test_djax_tiny_is_the_default_and_has_every_v41_feature(tiny41):
    from djax.cli import default_checkpoint
    from djax.engine import DEFAULT_MODEL

    config, params, tokenizer = tiny41
    assert DEFAULT_MODEL == default_checkpoint() == ASSET_V41
    assert (ASSET_V41 / "model.safetensors").stat().st_size <= 25e6
    assert config.is_v41 and config.num_hash_layers == 0
    assert set(config.compress_ratios) == {0, 1, 2}
    readers = [i for i in range(config.num_hidden_layers) if config.kv_source(i) not in (None, i)]
    assert {config.compress_ratios[i] for i in readers} == {1, 2}  # both pools are shared
    cs = config.candidate_source_layer_id
    assert any(i > cs and config.kv_source(i) == config.kv_source(cs) for i in config.index_source_layer_ids)
    assert config.engram_layer_ids and config.hc_mult > 1 and config.n_routed_experts > 1
    # One tokenizer for both tiny models; Engram's compressed-id map is the one the training script builds.
    assert (ASSET_V41 / "tokenizer.json").read_bytes() == (ASSET / "tokenizer.json").read_bytes()
    token_map, n = engram_token_map(tokenizer)
    assert n == config.engram_compressed_vocab_size
    np.testing.assert_array_equal(np.asarray(params["engram_token_map"]), token_map)


def test_djax_tiny_greedy_generation_is_deterministic(tiny41):
    assert greedy_text(tiny41) == EXPECTED_V41


def test_djax_tiny_decode_reproduces_forward_on_heldout_code(tiny41):
    """A 64-token prefill (below the bounded-replay threshold: exact), then 96 teacher-forced decode steps
    across window wraps and both compression ratios: each step's logits equal the full forward's."""
    config, params, tokenizer = tiny41
    inputs, targets = heldout_windows(tokenizer, None, 160, max_files=1)
    tokens, targets = inputs[:1], targets[:1]
    full = np.asarray(djax.forward(params, jnp.asarray(tokens), config))[0]
    nll, count = nll_sum(full[None], targets)
    assert np.exp(nll / count) < 40  # trained: a uniform guess over 8192 tokens scores 8192
    p = 64
    logits, state = djax.prefill(params, jnp.asarray(tokens[:, :p]), jnp.asarray([p]), config, 256)
    steps = [np.asarray(logits)[0]]
    for t in range(p, tokens.shape[1] - 1):
        logits, state = djax.decode(params, jnp.asarray(tokens[:, t]), state, config)
        steps.append(np.asarray(logits)[0])
    got, want = np.stack(steps), full[p - 1 : -1]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_the_cli_main_job_completes_as_generate_does(tiny41, capsys):
    """The README's main job, `djax generate` on the embedded default model (its own prefill and per-token
    decode loop, greedy by default), writes the text `djax.generate` produces for the same prompt."""
    from djax.cli import main

    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt_tokens"] == len(tiny41[2].encode(PROMPT).ids) and len(out["tokens"]) == 24
    assert out["text"] == EXPECTED_V41
