"""The reasoning parsers (`reasoning`) without a model: every split of a reply into
deltas gives the same reasoning and content as the whole reply, a marker cut across
deltas is never sent as content, a reply with no end marker is all reasoning, one with
no markers all content; how the parser and the thinking switch are found in a chat
template; the chat deltas (tool calls looked for in the answer only) and the Responses
API's reasoning items and events."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

import pydantic
import pytest

from radixserve.cli import make_parser
from radixserve.services.gateway.openai_api.choices import Choice, reply_deltas
from radixserve.services.gateway.responses_api.output import ResponseBuilder
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.tools.reasoning import (
    PARSERS,
    SETTING_VALUES,
    HarmonyStream,
    ReasoningFormat,
    ThinkStream,
    parser_for_template,
    prompt_opens,
    split_reasoning,
)
from radixserve.services.gateway.tools.tool_request import ToolPlan

QWEN3_REPLY = "<think>\nFirst, 2 < 3.\nThen more.\n\n</think>\n\nThe answer is 3."
HARMONY_REPLY = ("<|channel|>analysis<|message|>User asks; 2 < 3.<|end|><|start|>assistant"
                 "<|channel|>final<|message|>The answer is 3.")  # fmt: skip


def _feed(stream, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    segments = [s for piece in pieces for s in stream.feed(piece)] + stream.finish()
    reasoning = "".join(t for kind, t in segments if kind == "reasoning")
    content = "".join(t for kind, t in segments if kind == "content")
    return reasoning, content, segments


def _splits(text: str) -> list[list[str]]:
    """`text` cut once at every position, and one character at a time."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    return [*cuts, list(text)]


@pytest.mark.parametrize(
    ("make", "text", "want"),
    [
        (ThinkStream, QWEN3_REPLY, ("First, 2 < 3.\nThen more.", "The answer is 3.")),
        (lambda: ThinkStream(reasoning=True), "Hmm, so.\n</think>\n\nYes.", ("Hmm, so.", "Yes.")),
        (lambda: ThinkStream(reasoning=True), "<think>\nHmm.</think>Yes.", ("Hmm.", "Yes.")),
        (HarmonyStream, HARMONY_REPLY, ("User asks; 2 < 3.", "The answer is 3.")),
    ],
    ids=["qwen3", "prompt-opened", "prompt-opened-repeated-start", "harmony"],
)
def test_every_split_of_a_reply_gives_the_whole_replys_parts(make, text, want):
    assert split_reasoning(make(), text) == want
    for pieces in _splits(text):
        reasoning, content, segments = _feed(make(), pieces)
        assert (reasoning, content) == want, pieces
        for kind, piece in segments:  # nothing of a marker or of the reasoning leaks
            assert kind == "reasoning" or ("<" not in piece and "2" not in piece), pieces


def test_no_end_marker_is_all_reasoning():
    assert split_reasoning(ThinkStream(), "<think>\nStill thinking\n") == ("Still thinking", "")
    assert split_reasoning(ThinkStream(reasoning=True), "Still </thi") == ("Still </thi", "")
    for pieces in _splits("\nStill thinking\n"):
        assert _feed(ThinkStream(reasoning=True), pieces)[:2] == ("Still thinking", "")
    assert split_reasoning(HarmonyStream(), "<|channel|>analysis<|message|>So") == ("So", "")


@pytest.mark.parametrize("text", ["Just an answer.", "\n  Leading space.", "a <think> later",
                                  "<thin", "  "])  # fmt: skip
def test_a_reply_without_reasoning_is_content_unchanged(text):
    for pieces in _splits(text):
        assert _feed(ThinkStream(), pieces)[:2] == ("", text), pieces
    assert split_reasoning(HarmonyStream(), text) == ("", text)


def test_where_the_prompt_leaves_the_stream():
    assert prompt_opens("<|im_start|>assistant\n<think>\n") is True
    assert prompt_opens("assistant\n<think>\n\n</think>\n\n") is False
    assert prompt_opens("<|im_start|>assistant\n") is None
    # deepseek_r1 reasons from the start unless the prompt closed the block; qwen3 only
    # when the prompt opened it (or the reply does)
    r1, qwen3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]
    assert split_reasoning(r1.stream(None), "Hmm</think>Yes") == ("Hmm", "Yes")
    assert split_reasoning(r1.stream(False), "Yes") == ("", "Yes")
    assert split_reasoning(qwen3.stream(None), "Hmm</think>Yes") == ("", "Hmm</think>Yes")
    assert split_reasoning(qwen3.stream(True), "Hmm</think>Yes") == ("Hmm", "Yes")


QWEN3_LIKE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
R1_LIKE = ("{% for m in messages %}{{ m.role }}: {{ m.content | replace('</think>', '') }}\n"
           "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")  # fmt: skip
HARMONY_LIKE = ("{{ 'Reasoning: ' + (reasoning_effort or 'medium') }}{% for m in messages %}"
                "<|start|>{{ m.role }}<|channel|>analysis<|message|>{{ m.content }}<|end|>"
                "{% endfor %}<|start|>assistant")  # fmt: skip
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


@pytest.mark.parametrize(
    ("source", "parser", "switch"),
    [(QWEN3_LIKE, "qwen3", "enable_thinking"), (R1_LIKE, "deepseek_r1", None),
     (HARMONY_LIKE, "gpt_oss", "reasoning_effort"), (CHATML, "none", None), (None, "none", None)],
    ids=["qwen3", "deepseek_r1", "gpt_oss", "chatml", "no-template"],
)  # fmt: skip
def test_the_parser_and_switch_come_from_the_template(source, parser, switch):
    assert parser_for_template(source) == parser
    assert ReasoningFormat.for_template(source) == ReasoningFormat(parser, switch)
    assert ReasoningFormat.for_template(source, "qwen3").parser == "qwen3"  # the setting wins


def test_effort_maps_to_the_switch_or_is_refused_by_name():
    qwen3 = ReasoningFormat("qwen3", "enable_thinking")
    assert qwen3.effort_variables("none", "reasoning.effort") == {"enable_thinking": False}
    assert qwen3.effort_variables("minimal", "reasoning.effort") == {"enable_thinking": False}
    assert qwen3.effort_variables("low", "reasoning.effort") == {"enable_thinking": True}
    assert qwen3.effort_variables(None, "reasoning.effort") == {}
    harmony = ReasoningFormat("gpt_oss", "reasoning_effort")
    assert harmony.effort_variables("high", "x") == {"reasoning_effort": "high"}
    plain = ReasoningFormat("none")
    assert plain.effort_variables("medium", "reasoning.effort") == {}
    for fmt, effort in ((plain, "high"), (plain, "none"), (harmony, "none")):
        with pytest.raises(OpenAIError) as refused:
            fmt.effort_variables(effort, "reasoning.effort")
        assert refused.value.status == 400 and refused.value.param == "reasoning.effort"
        assert refused.value.message.startswith("reasoning.effort")


def test_tool_calls_are_looked_for_in_the_answer_only():
    """A call written inside the reasoning stays reasoning; the answer's call is parsed,
    streamed or whole."""
    call = '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"<think>\nMaybe {call}?\n</think>\n\n{call}"
    plan = ToolPlan("hermes", frozenset({"get"}), single=False)
    for incremental in (False, True):
        c = Choice(tools=plan.stream(incremental), reasoning=ThinkStream())
        pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
        deltas = [d for i, p in enumerate(pieces) for d in
                  reply_deltas(c, p, i == len(pieces) - 1)]  # fmt: skip
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert reasoning == f"Maybe {call}?"
        assert "".join(d.get("content") or "" for d in deltas) == ""
        assert c.tools is not None and [x["function"]["name"] for x in c.tools.calls] == ["get"]


def test_responses_reasoning_item_comes_before_the_message():
    builder = ResponseBuilder({"id": "resp_x", "output": []})
    builder.opening()
    events = builder.feed([{"reasoning_content": "Hmm"}, {"reasoning_content": ", yes"},
                           {"content": "Yes."}])  # fmt: skip
    events += builder.finish("stop", {})
    kinds = [e["type"] for e in events]
    assert kinds[:8] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added",
    ]  # fmt: skip
    reasoning, message = builder.body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm, yes"}]
    assert reasoning["status"] == "completed" and reasoning["id"].startswith("rs_")
    assert message["content"][0]["text"] == "Yes."
    seq = [e["sequence_number"] for e in events]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)


def test_the_setting_and_the_flag_take_the_same_values():
    field = GatewaySettings.model_fields["reasoning_parser"]
    assert typing.get_args(field.annotation) == SETTING_VALUES
    assert set(SETTING_VALUES) == {"auto", "none", *PARSERS}
    with pytest.raises(pydantic.ValidationError, match="reasoning_parser"):
        GatewaySettings(reasoning_parser="qwen4")
    parser = make_parser()
    for command in ("serve", "up"):
        args = parser.parse_args([command, "--reasoning-parser", "deepseek_r1"])
        assert args.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["serve", "--reasoning-parser", "qwen4"])
    assert refused.value.code == 2


def test_the_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_GATEWAY_REASONING_PARSER", "gpt_oss")
    assert GatewaySettings().reasoning_parser == "gpt_oss"
    monkeypatch.setenv("RADIXSERVE_GATEWAY_REASONING_PARSER", "bogus")
    with pytest.raises(pydantic.ValidationError, match="reasoning_parser"):
        GatewaySettings()


def test_a_bad_value_is_refused_by_the_command_by_name():
    """The commands users run: the flag's choices, and the setting from the environment."""
    cli = [sys.executable, "-m", "radixserve.cli"]
    flag = subprocess.run([*cli, "serve", "--reasoning-parser", "qwen4"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert flag.returncode == 2 and "--reasoning-parser" in flag.stderr
    env = {**os.environ, "RADIXSERVE_GATEWAY_REASONING_PARSER": "qwen4"}
    setting = subprocess.run([*cli, "gateway", "--check-config"], capture_output=True,
                             text=True, timeout=120, env=env)  # fmt: skip
    assert setting.returncode == 2 and "reasoning_parser" in setting.stderr
    env["RADIXSERVE_GATEWAY_REASONING_PARSER"] = "deepseek_r1"
    good = subprocess.run([*cli, "gateway", "--check-config"], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert good.returncode == 0 and '"reasoning_parser": "deepseek_r1"' in good.stdout
