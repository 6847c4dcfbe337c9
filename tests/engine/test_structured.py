"""Structured output: what a random-weight model writes under each kind of constraint is checked by an
independent validator (jsonschema, re.fullmatch, the choice list), rows with different constraints
and unconstrained rows share steps, and a grammar that is complete ends the request with "stop"."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams, StructuredOutputsParams
from batchgen.engine.sampling.structured import check_structured

PROMPTS = ["once upon a time", "the cat liked to play", "a little dog", "there was a sun", "her friend"]
SCHEMA_A: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["ok", "color", "tag"],
    "additionalProperties": False,
}
SCHEMA_B: dict[str, Any] = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 2,
    "maxItems": 3,
}
REGEX = r"[ab]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe not"]
EBNF = 'root ::= ("up" | "down") " " [0-9] "!"'


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_num_seqs=32)


def _params(structured: dict[str, Any] | None, **kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 60, "temperature": 1.0, "seed": 1, **kwargs}, structured=structured)


def _valid(kind: str, text: str) -> bool:
    if kind in ("a", "b"):
        try:
            jsonschema.validate(json.loads(text), SCHEMA_A if kind == "a" else SCHEMA_B)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    pattern = {"regex": REGEX, "choice": "|".join(map(re.escape, CHOICES)), "ebnf": r"(up|down) [0-9]!"}[kind]
    return re.fullmatch(pattern, text) is not None


def test_every_kind_validates_in_one_mixed_batch(llm: LLM) -> None:
    kinds: dict[str, dict[str, Any] | None] = {
        "a": {"json_schema": SCHEMA_A},
        "b": {"json_schema": json.dumps(SCHEMA_B)},  # JSON text works as well as a mapping
        "regex": {"regex": REGEX},
        "choice": {"choice": CHOICES},
        "ebnf": {"grammar": EBNF},
        "free": None,
    }
    prompts, params, labels = [], [], []
    for temperature in (0.0, 1.0):
        for kind, spec in kinds.items():
            for i, prompt in enumerate(PROMPTS):
                prompts.append(prompt)
                params.append(_params(spec, temperature=temperature, seed=i))
                labels.append(kind)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    for kind, out in zip(labels, outs):
        if kind == "free":
            continue
        assert _valid(kind, out.text), (kind, out.text)
        assert out.finish_reason == "stop", (kind, out.text, out.finish_reason)
        assert out.stop_reason is None  # ended by the EOS the complete grammar allows: None, as any EOS
    free = [o.text for k, o in zip(labels, outs) if k == "free"]
    assert not all(_valid("a", t) for t in free)  # the unconstrained rows really are unconstrained
    assert llm.engine.runner.batch.num_rows == 0  # every request's state (its grammar matcher) released


def test_the_grammar_ends_the_request_even_when_eos_is_ignored(llm: LLM) -> None:
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, _params({"regex": REGEX}, ignore_eos=True))]
    for out in outs:
        assert re.fullmatch(REGEX, out.text), out.text
        assert out.finish_reason == "stop" and out.stop_reason is None


def test_the_grammar_wins_over_min_tokens(llm: LLM) -> None:
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, _params({"choice": ["no"]}, min_tokens=20, temperature=0.0))]
    for out in outs:
        assert out.text == "no" and out.finish_reason == "stop"


def test_compiled_grammars_are_cached_by_their_text(llm: LLM) -> None:
    features = llm.engine.runner.sampler.features  # type: ignore[union-attr]  # the engine's runner samples
    assert features is not None
    before = len(features.grammars._compiled)
    reordered = dict(reversed(list(SCHEMA_A.items())))  # same schema, other key order: same text
    specs = [{"json_schema": SCHEMA_A}, {"json_schema": reordered}, {"regex": "z{2}"}, {"regex": "z{2}"}]
    llm.generate(PROMPTS[:4], [_params(s) for s in specs])
    assert len(features.grammars._compiled) - before <= 2


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"json_schema": {"type": "nonsense"}}, "json_schema does not compile"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"regex": "(unclosed"}, "regex does not compile"),
        ({"grammar": "root ::= undefined_rule"}, "grammar does not compile"),
    ],
)
def test_a_spec_that_cannot_compile_names_the_problem(llm: LLM, spec: dict[str, Any], needle: str) -> None:
    problem = check_structured(spec)
    assert problem is not None and needle in problem
    out = llm.generate(PROMPTS[:2], [_params(spec), _params(None, max_tokens=3)])
    assert not out[0].outputs and needle in (out[0].error or "")
    assert out[1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("value", [{}, {"regex": "a", "choice": ["a"]}, {"json_object": False}, {"choice": []}])
def test_malformed_structured_settings_are_refused(value: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.structured must be"):
        SamplingParams(structured=value)


def test_every_sample_of_an_n_request_follows_the_schema(llm: LLM) -> None:
    # Forked samples share the prompt's blocks but each needs its own grammar state: a shared
    # matcher would see the other samples' tokens and reject (or mis-terminate) them.
    outs = llm.generate(PROMPTS[:3], _params({"json_schema": SCHEMA_A}, n=4))
    for out in outs:
        assert len(out.outputs) == 4
        for sample in out.outputs:
            assert _valid("a", sample.text), sample.text
            assert sample.finish_reason == "stop"
    texts = {s.text for out in outs for s in out.outputs}
    assert len(texts) > 1  # temperature 1.0, distinct per-sample seeds: not one text repeated


def _blanks_outside_strings(text: str) -> list[int]:
    """Offsets of whitespace outside JSON strings, except the one space xgrammar writes after , and :."""
    found, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            in_string, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            in_string = True
        elif ch.isspace() and not (ch == " " and i > 0 and text[i - 1] in ",:"):
            found.append(i)
    return found


def test_json_object_forces_an_object_without_free_whitespace(llm: LLM) -> None:
    # vLLM compiles json_object as the schema {"type": "object"}: an array, a string or a number is
    # not an object, and blanks between tokens are not allowed (a small model would write them forever).
    prompts = PROMPTS * 4
    api = StructuredOutputsParams(json_object=True)  # the vLLM spelling, half the rows
    params = [
        _params({"json_object": True}, max_tokens=120, seed=i)
        if i % 2
        else SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=api)
        for i in range(len(prompts))
    ]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    finished = [o.text for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= len(outs) // 2, [o.text for o in outs]
    for text in finished:
        assert isinstance(json.loads(text), dict), text
    for out in outs:  # a cut output too is the start of an object with no free blanks
        assert out.text.startswith("{") and not _blanks_outside_strings(out.text), out.text
