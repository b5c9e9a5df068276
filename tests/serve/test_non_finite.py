"""NaN and Infinity sent as numbers are refused with one sentence wherever they enter (serve/errors.py
`non_finite_refusal`): a JSON body, a pydantic error's input, a form field. No server needed."""

from __future__ import annotations

import pytest

from snapref_ray.serve.api import parse_json_object
from snapref_ray.serve.errors import ApiError, non_finite_refusal


def test_only_a_non_finite_float_is_refused():
    assert [non_finite_refusal(v) for v in (1.0, 0, "NaN", None, True)] == [None] * 5
    assert non_finite_refusal(float("nan")) == "NaN is not a number this API accepts; send a finite number"
    assert non_finite_refusal(float("-inf")) == "Infinity is not a number this API accepts; send a finite number"
    assert non_finite_refusal(float("-inf"), "-Infinity", why=" (because)") == (
        "-Infinity is not a number this API accepts (because); send a finite number"
    )


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_a_json_body_names_the_field_and_the_token_as_sent(token):
    with pytest.raises(ApiError) as refused:
        parse_json_object(f'{{"prompt": "p", "cfg": {token}}}'.encode(), {"prompt", "cfg"})
    assert (refused.value.status, refused.value.field) == (400, "cfg")
    assert refused.value.message == (
        f"{token} is not a number this API accepts (NaN and Infinity are refused); send a finite number"
    )
