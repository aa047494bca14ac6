"""The per-token update is built positionally for speed; its fields must still land by name."""

from jaxlora.engine.request import FinishReason, RequestOutput, TokenLogprob, token_output


def test_token_output_equals_keyword_construction():
    built = token_output("req-7", "ab", 42, 11, 3)
    expected = RequestOutput(request_id="req-7", text="ab", token_ids=(42,), prompt_tokens=11, completion_tokens=3)
    assert built == expected
    assert type(built) is RequestOutput
    assert built._asdict() == expected._asdict()
    assert built.finished is False and built.finish_reason is None and built.error is None
    assert built.logprobs is None
    entry = TokenLogprob(42, -0.5, ((42, -0.5),))
    with_logprob = token_output("req-7", "ab", 42, 11, 3, entry)
    assert with_logprob == expected._replace(logprobs=(entry,))


def test_request_output_fields_are_the_ones_token_output_fills():
    # token_output writes a tuple in this exact order: a new or moved field must update it.
    assert RequestOutput._fields == (
        "request_id",
        "text",
        "token_ids",
        "finished",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "error",
        "logprobs",
    )
    assert RequestOutput(request_id="x", finish_reason=FinishReason.STOP).finish_reason is FinishReason.STOP
