"""The command line end to end on tiny checkpoints: `generate` (text and --json, GGUF file and HF dir, with and
without speculation) and every user error giving one clear line on stderr, exit code 2, no traceback."""
import json

import pytest

from draftwise.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path / "cache"))


def test_generate_json_from_gguf_with_speculation(capsys, tiny_gguf_path):
    spec_config = '{"method":"draft_model","model":"%s","num_speculative_tokens":3}' % tiny_gguf_path
    code, out, err = run(capsys, "generate", "--model", str(tiny_gguf_path), "--prompt", "hello world",
                         "--max-tokens", "12", "--ignore-eos", "--json", "--speculative-config", spec_config)
    assert code == 0, err
    d = json.loads(out.strip().splitlines()[-1])
    for key in ("text", "prompt_ids", "output_ids", "num_prompt_tokens", "num_output_tokens", "ttft_s", "total_s",
                "tokens_per_s", "finish_reason", "spec"):
        assert key in d
    assert d["num_output_tokens"] == len(d["output_ids"]) == 12 and d["finish_reason"] == "length"
    assert d["spec"]["num_drafts"] > 0 and d["spec"]["acceptance_rate"] == 1.0  # draft == target
    code, out2, _ = run(capsys, "generate", "--model", str(tiny_gguf_path), "--prompt", "hello world",
                        "--max-tokens", "12", "--ignore-eos", "--json")
    plain = json.loads(out2.strip().splitlines()[-1])
    assert plain["output_ids"] == d["output_ids"] and plain["spec"] is None


def test_generate_streams_text_from_hf_dir(capsys, tiny_hf_dir):
    code, out, err = run(capsys, "generate", "--model", str(tiny_hf_dir), "--prompt", "hello", "--max-tokens", "5",
                         "--ignore-eos")
    assert code == 0, err
    assert out.endswith("\n")
    assert "draftwise: target kernels " in err and "row-exact" in err  # the load log names the plan


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "qwen2.5-coder-1.5b-instruct"),  # unknown name lists the catalog
    (["--device", "cuda"], "cuda"),
    (["--speculative-config", '{"method":"ngram","num_speculative_tokens":3,"bogus":1}'], "bogus"),
    (["--speculative-config", '{"method":"ngram","num_speculative_tokens":0}'], "num_speculative_tokens"),
    (["--speculative-config", "{not json"], "not valid JSON"),
    (["--max-model-len", "16", "--max-tokens", "20"], "exceeds the context length of 16"),
    (["--temperature", "-1"], "temperature"),
])
def test_user_errors_are_one_line(capsys, tiny_gguf_path, argv, message):
    import torch

    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    base = ["generate", "--model", str(tiny_gguf_path), "--prompt", "hello", "--max-tokens", "4"]
    code, out, err = run(capsys, *(base + argv))
    assert code == 2
    last = err.strip().splitlines()[-1]  # progress bars (conversion) may come before it
    assert last.startswith("error: ") and message in last and "Traceback" not in err


class _Tok:
    def __init__(self, vocab, eos=(2,), bos=1):
        self.vocab, self.eos_token_ids, self.bos_token_id = vocab, eos, bos

    def get_vocab(self):
        return dict(self.vocab)


def test_draft_with_a_different_vocabulary_is_refused():
    from draftwise.config import ConfigError
    from draftwise.spec_decode.draft_model import check_compatible

    base = {"a": 0, "<s>": 1, "</s>": 2, "b": 3}
    check_compatible(_Tok(base), _Tok(dict(base)), "t", "d")  # same vocabulary: fine
    with pytest.raises(ConfigError, match="only in draft: \\['c'\\]"):
        check_compatible(_Tok(base), _Tok({**base, "c": 4}), "t", "d")
    with pytest.raises(ConfigError, match="different ids"):
        check_compatible(_Tok(base), _Tok({**base, "a": 3, "b": 0}), "t", "d")
    with pytest.raises(ConfigError, match="special tokens"):
        check_compatible(_Tok(base), _Tok(base, eos=(3,)), "t", "d")


def test_models_lists_catalog(capsys):
    code, out, _ = run(capsys, "models", "--json")
    names = [r["name"] for r in json.loads(out)]
    assert code == 0 and "qwen2.5-coder-0.5b-instruct" in names and "gemma-3-270m" in names


def test_generate_json_schema(capsys, tiny_gguf_path, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    spec_config = '{"method":"grammar","num_speculative_tokens":4,"then":{"method":"ngram"}}'
    code, out, err = run(capsys, "generate", "--model", str(tiny_gguf_path), "--prompt", "hello", "--max-tokens",
                         "40", "--json", "--json-schema", str(path), "--speculative-config", spec_config)
    assert code == 0, err
    d = json.loads(out.strip().splitlines()[-1])
    if d["finish_reason"] == "stop":  # free whitespace may run past 40 tokens: then it says "length"
        assert isinstance(json.loads(d["text"])["ok"], bool)
    # whether free-whitespace JSON forces any token depends on the model (tests/test_structured_engine.py pins
    # forced tokens with compact JSON); the counters are reported either way
    assert 0 <= d["spec"]["num_accepted_forced_tokens"] <= d["spec"]["num_forced_tokens"]
    code, _, err = run(capsys, "generate", "--model", str(tiny_gguf_path), "--prompt", "hello",
                       "--json-schema", str(tmp_path / "missing.json"))
    assert code == 2 and "--json-schema" in err and "Traceback" not in err
    path.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    code, _, err = run(capsys, "generate", "--model", str(tiny_gguf_path), "--prompt", "hello",
                       "--json-schema", str(path))
    assert code == 2 and "uniqueItems" in err
