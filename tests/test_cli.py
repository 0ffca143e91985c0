"""CLI wiring of consumers' commands: `gradtap inspect` (detect dumps), `gradtap explain --hf`
(Hugging Face models built from a config; transformers is in the test extra)."""

from __future__ import annotations

import fnmatch
import re
import sys

import pytest
import torch
from torch import nn

import gradtap as gt
from gradtap.cli import main
from gradtap.integrations import hf_models


class SqrtOfInput(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def test_inspect_prints_the_dump_report(tmp_path, capsys):
    net = nn.Sequential(nn.Linear(4, 4), SqrtOfInput(), nn.Linear(4, 2))
    with torch.no_grad():
        net[0].bias.fill_(-100.0)  # sqrt of negatives: a forward NaN in module "1"
    with gt.detect(net, action="record", dump_dir=tmp_path / "dumps") as det:
        net(torch.randn(3, 4)).sum().backward()
        det.step()
    anomaly = det.anomalies[0]
    assert anomaly.module_name == "1"
    assert main(["inspect", anomaly.dump_path]) == 0
    assert capsys.readouterr().out.startswith(anomaly.message)
    assert main(["inspect", str(tmp_path / "missing.pt")]) == 2
    assert "gradtap inspect: error:" in capsys.readouterr().err


# --------------------------------------------------------------------------- explain --hf

GPT2 = "n_layer=2,n_embd=32,n_head=2"
VIT = "image_size=16,patch_size=8,hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32,num_labels=3"
T5 = "d_model=16,d_kv=8,d_ff=32,num_layers=1,num_decoder_layers=1,num_heads=2,vocab_size=64"


def _blocks(out: str) -> dict[str, list[str]]:
    """``{module name: table lines}`` of an explain printout (call 0 of each module)."""
    blocks = {}
    for block in out.split("\n\n"):
        lines = block.splitlines()
        m = re.match(r"\S+ '(.*)' call 0$", lines[0]) if lines else None
        if m:
            blocks[m.group(1)] = lines[1:]
    return blocks


def _norm(lines: list[str], slot: str) -> float:
    row = next(line for line in lines if line.split()[0] == slot)
    return float(row.split()[4])


def _oracle_grad_norm(model_type: str, config: str, task: str, param: str) -> float:
    """Rebuild the same model and input (same seed) and take the gradient by plain autograd."""
    torch.manual_seed(0)
    model, inputs = hf_models.model_and_inputs(model_type, hf_models.parse_config(config), task)
    out = model(**inputs)
    loss = sum(v.sum() for v in out.values() if torch.is_tensor(v) and v.is_floating_point())
    (grad,) = torch.autograd.grad(loss, [dict(model.named_parameters())[param]])
    return float(grad.norm())


def test_explain_hf_gpt2_honors_select_and_matches_autograd(capsys):
    assert main(["explain", "--hf", "gpt2", "--config", GPT2, "--select", "transformer.h.0.*"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPT2LMHeadModel (gpt2, ") and "on input_ids [2, 8] int64" in out
    blocks = _blocks(out)
    assert blocks and all(fnmatch.fnmatchcase(n, "transformer.h.0.*") for n in blocks)
    assert {"transformer.h.0.attn", "transformer.h.0.mlp.c_fc", "transformer.h.0.ln_1"} <= set(blocks)
    expected = _oracle_grad_norm("gpt2", GPT2, "auto", "transformer.h.0.mlp.c_fc.weight")
    assert _norm(blocks["transformer.h.0.mlp.c_fc"], "weight") == pytest.approx(expected, rel=1e-3)


def test_explain_hf_vision_model(capsys):
    assert main(["explain", "--hf", "vit", "--config", VIT, "--select", "classifier"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ViTForImageClassification (vit, ")
    assert "on pixel_values [2, 3, 16, 16] float32" in out
    blocks = _blocks(out)
    assert list(blocks) == ["classifier"]
    expected = _oracle_grad_norm("vit", VIT, "auto", "classifier.weight")
    assert _norm(blocks["classifier"], "weight") == pytest.approx(expected, rel=1e-3)


def test_explain_hf_encoder_decoder_gets_decoder_input_ids(capsys):
    argv = ["explain", "--hf", "t5", "--config", T5, "--select", "*.block.0.layer.0.SelfAttention.q"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("T5ForConditionalGeneration (t5, ")
    assert "on input_ids [2, 8] int64, decoder_input_ids [2, 8] int64" in out
    blocks = _blocks(out)
    assert set(blocks) == {"encoder.block.0.layer.0.SelfAttention.q",
                           "decoder.block.0.layer.0.SelfAttention.q"}
    expected = _oracle_grad_norm("t5", T5, "auto", "encoder.block.0.layer.0.SelfAttention.q.weight")
    assert _norm(blocks["encoder.block.0.layer.0.SelfAttention.q"], "weight") == pytest.approx(expected, rel=1e-3)
    # --task picks another auto class
    assert main(["explain", "--hf", "t5", "--config", T5, "--task", "base", "--select", "encoder"]) == 0
    assert capsys.readouterr().out.startswith("T5Model (t5, ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf", "gtp2"], r"unknown model type 'gtp2' for transformers .*closest: gpt2"),
        (["--hf", "gpt2", "--config", "n_lyer=2"],
         r"--config: GPT2Config \('gpt2'\) has no setting 'n_lyer' \(closest: n_layer"),
        (["--hf", "gpt2", "--config", "n_layer"], r"--config: expected key=value items .* got 'n_layer'"),
        (["--hf", "vit", "--config", VIT, "--task", "causal-lm"],
         r"--task causal-lm: transformers has no AutoModelForCausalLM class for model type 'vit'; "
         r"tasks it has: base, image-classification"),
        (["--hf", "gpt2", "--task", "poetry"], r"--task: unknown task 'poetry'; expected auto or one of"),
        (["--hf", "gpt2", "--config", "n_layer=1,n_embd=30,n_head=4"],
         r"cannot build AutoModelForPreTraining for 'gpt2' .*divisible"),
        (["--hf", "gpt2", "--config", "n_layer=2,n_embd=32"],
         r"cannot build .*divisible by num_heads.* set n_head or num_attention_heads too"),
        (["--hf", "gpt2", "--config", GPT2, "--select", "h.9"], r"select='h\.9' matches no module"),
        (["--hf", "gpt2", "--input-shape", "2,3"], r"--input-shape does not apply to --hf"),
        (["--example", "convnet", "--config", "n_layer=2"], r"--config and --task go with --hf"),
    ],
)
def test_explain_hf_usage_errors_exit_2(argv, message, capsys):
    assert main(["explain", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search("gradtap explain: error: " + message, captured.err), captured.err


def test_explain_hf_without_transformers_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    assert main(["explain", "--hf", "gpt2", "--config", GPT2]) == 2
    err = capsys.readouterr().err
    assert "needs transformers" in err and 'pip install "gradtap[transformers]"' in err
    assert 'pip install -c constraints.txt ".[transformers]"' in err


def test_parse_config_reads_python_literals_else_strings():
    parsed = hf_models.parse_config(
        "a=2, b=1e-5,c=True,d=None,e=[8, 16],f=gelu_new,g='x,y',h=(1,2),i=-3,j={'k': 1}"
    )
    assert parsed == {"a": 2, "b": 1e-5, "c": True, "d": None, "e": [8, 16], "f": "gelu_new",
                      "g": "x,y", "h": (1, 2), "i": -3, "j": {"k": 1}}
    assert type(parsed["a"]) is int and type(parsed["c"]) is bool
    assert hf_models.parse_config("") == {}
    with pytest.raises(hf_models.HFModelError, match=r"'a' is given twice"):
        hf_models.parse_config("a=1,a=2")
    with pytest.raises(hf_models.HFModelError, match=r"expected key=value .* got '2x=1'"):
        hf_models.parse_config("2x=1")


# Tiny configs of each family the dummy input knows (mamba where transformers has it).
FAMILIES = {
    "gpt2": dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=6),
    "bert": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 vocab_size=64),
    "t5": dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=64),
    "bart": dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64),
    "llama": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=32, vocab_size=64),
    "vit": dict(image_size=(16, 24), patch_size=8, hidden_size=16, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=32, num_channels=2),
    "wav2vec2": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     conv_dim=[8, 8], conv_kernel=[10, 3], conv_stride=[5, 2],
                     num_feat_extract_layers=2, num_conv_pos_embeddings=8,
                     num_conv_pos_embedding_groups=2, codevector_dim=8, proj_codevector_dim=8),
    "whisper": dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64,
                    pad_token_id=0, num_mel_bins=8, max_source_positions=12, max_target_positions=5),
    "mamba": dict(hidden_size=16, num_hidden_layers=1, state_size=4, vocab_size=64),
}
# the shapes each family's dummy input must have, from the config above
SHAPES = {
    "gpt2": {"input_ids": [2, 6]},
    "bert": {"input_ids": [2, 8]},
    "t5": {"input_ids": [2, 8], "decoder_input_ids": [2, 8]},
    "bart": {"input_ids": [2, 8], "decoder_input_ids": [2, 8]},
    "llama": {"input_ids": [2, 8]},
    "vit": {"pixel_values": [2, 2, 16, 24]},
    "wav2vec2": {"input_values": [2, ((8 - 1) * 2 + 3 - 1) * 5 + 10]},
    "whisper": {"input_features": [2, 8, 24], "decoder_input_ids": [2, 5]},
    "mamba": {"input_ids": [2, 8]},
}
AUTO_CLASS = {"gpt2": "GPT2LMHeadModel", "bert": "BertForPreTraining",
              "t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration",
              "llama": "LlamaForCausalLM", "vit": "ViTForImageClassification",
              "wav2vec2": "Wav2Vec2ForPreTraining", "whisper": "WhisperForConditionalGeneration",
              "mamba": "MambaForCausalLM"}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("task", ["auto", "base"])
def test_each_family_builds_and_explains_on_its_dummy_input(model_type, task):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model, inputs = hf_models.model_and_inputs(model_type, FAMILIES[model_type], task)
    assert not model.training
    if task == "auto":
        assert type(model).__name__ == AUTO_CLASS[model_type]
    shapes = {k: list(v.shape) for k, v in inputs.items() if torch.is_tensor(v)}
    assert shapes == SHAPES[model_type]
    ids = [v for k, v in inputs.items() if k.endswith("input_ids")]
    assert all(0 <= int(v.min()) and int(v.max()) < 64 for v in ids)
    ex = gt.explain(model, inputs)
    assert ex.records
    # every parameter the loss reaches has its p.grad share in some record
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = model(**inputs)
    loss = sum(v.sum() for v in out.values() if torch.is_tensor(v) and v.is_floating_point())
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    reached = {id(p) for p, g in zip(named.values(), grads) if g is not None}
    recorded = {id(model.get_parameter(f"{r.module_name}.{k}" if r.module_name else k))
                for r in ex.records for k, g in r.param_grads.items() if g is not None}
    assert reached and reached <= recorded  # by identity: tied weights have two names


# --------------------------------------------------------------------------- errors


def test_errors_name_the_subcommand_not_the_argument_list(capsys):
    assert main(["watch", "--stats", "norm,bogus", "--", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradtap watch: error: ") and "[" not in err.split(":")[0]


def test_explain_with_a_wrong_input_shape_says_so_in_one_line(tmp_path, capsys):
    (tmp_path / "net.py").write_text(
        "from torch import nn\n\ndef make():\n    return nn.Sequential(nn.Linear(4, 3))\n")
    target = f"{tmp_path / 'net.py'}:make"
    assert main(["explain", target, "--input-shape", "2,5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.match(r"gradtap explain: error: the model's forward failed on a random input of "
                    r"shape \(2, 5\): .*; is --input-shape right\?", err), err
    assert main(["explain", target, "--input-shape", "2,4"]) == 0


def test_explain_of_a_model_without_a_floating_output_points_to_python(tmp_path, capsys):
    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n\nclass Argmax(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 3)\n"
        "    def forward(self, x):\n        return self.fc(x).argmax(-1)\n\n"
        "def make():\n    return Argmax()\n")
    assert main(["explain", f"{tmp_path / 'net.py'}:make", "--input-shape", "2,4"]) == 2
    err = capsys.readouterr().err
    assert "pass loss= in Python: gt.explain(model, inputs, loss=...)" in err, err


def test_explain_json_is_the_explanation_as_data(capsys):
    import json

    from gradtap import examples

    assert main(["explain", "--example", "convnet", "--json", "--seed", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["format"], doc["version"]) == ("gradtap.explain", 1)
    torch.manual_seed(0)
    model = examples.convnet()
    ex = gt.explain(model, torch.randn(2, 1, 28, 28))
    assert [(r["module_name"], r["call"]) for r in doc["records"]] == [
        (r.module_name, r.call) for r in ex.records]
    for got, rec in zip(doc["records"], ex.records):
        expected = {k: g for _, k, g in rec.slots()}
        for slot in got["slots"]:
            g = expected[slot["key"]]
            assert slot["shape"] == (None if g is None else list(g.shape))
            if g is not None:
                assert slot["norm"] == pytest.approx(float(g.double().norm()), rel=1e-6)


def test_demo_without_scikit_learn_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn...` fails
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert main(["demo", "--steps", "2", "--no-progress", "--out", str(tmp_path / "demo")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        'gradtap demo: error: the demo (its bundled digits data) needs scikit-learn, an optional '
        'dependency of gradtap: pip install "gradtap[demo]" (from a clone: pip install -c '
        'constraints.txt ".[demo]")\n')
