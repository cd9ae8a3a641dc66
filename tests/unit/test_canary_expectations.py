"""Content checks: the customer's defaults against each corruption they saw, and user-written checks."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from mooncake_operator.canary.expectations import (
    Contains,
    Expectation,
    JsonFieldEquals,
    JsonObjectOnly,
    JsonValuesExclude,
    JsonValuesInclude,
    NotContains,
    canonical,
    find_json_object,
    violations,
)
from mooncake_operator.canary.request import reference_expectations, reference_request

pytestmark = pytest.mark.unit

# The request body exactly as the customer's report prints it.
SEED_REQUEST = """{
    "model": "MiniMaxAI/MiniMax-M2.5",
    "messages": [
      {
        "role": "system",
        "content": "You maintain a deployment record. When a setting is updated, discard its previous value and answer only from the latest record."
      },
      {
        "role": "user",
        "content": "Initial rollout: region is us-east, replica count is 2, and maximum batch size is 8."
      },
      {
        "role": "assistant",
        "content": "Recorded the initial rollout."
      },
      {
        "role": "user",
        "content": "Production update: region is now us-west, replica count is 4, and maximum batch size is 16. The initial values are superseded."
      },
      {
        "role": "assistant",
        "content": "Recorded the production update."
      },
      {
        "role": "user",
        "content": "Return the current region, replica count, and maximum batch size as one JSON object."
      }
    ],
    "temperature": 0,
    "seed": 0,
    "max_tokens": 80,
    "stream": false
}"""  # noqa: E501

CORRECT = '{"region": "us-west", "replica_count": 4, "max_batch_size": 16}'
PARAPHRASE = "I keep the deployment record and answer only from its latest values."


def test_customer_request_is_the_seed_body_and_a_fresh_copy_each_call() -> None:
    assert reference_request() == json.loads(SEED_REQUEST)
    first = reference_request()
    first["messages"].clear()
    assert reference_request() == json.loads(SEED_REQUEST)


@pytest.mark.parametrize(
    "answer",
    [
        CORRECT,
        '  {"Region": "US-West", "replicas": "4", "maxBatchSize": 16.0}\n',
        '{"current": {"region": "us-west", "replica_count": 4, "max_batch_size": 16}}',
    ],
)
def test_customer_expectations_accept_correct_answers_whatever_the_key_names(answer: str) -> None:
    assert violations(reference_expectations(), answer) == []


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            '{"region": "us-east", "replica_count": 4, "max_batch_size": 16}',
            [
                'the JSON object holds no value "us-west"',
                'the JSON object holds the excluded value "us-east"',
            ],
        ),
        (
            '{"region": "us-west", "replica_count": 4, "max_batch_size": 8}',
            ["the JSON object holds no value 16", "the JSON object holds the excluded value 8"],
        ),
        ('{"region": "us-west", "replica_count": 4}', ["the JSON object holds no value 16"]),
        (
            PARAPHRASE + "\n" + CORRECT,
            [f"text before the JSON object: {PARAPHRASE!r}"],
        ),
        ('{"region": "us-west", "replica_count": 2, "max_batch_size": 16}', None),
        ("The region is us-west.", None),
    ],
    ids=["us-east mixed in", "old batch size", "field omitted", "paraphrase first", "old count", "no json"],
)
def test_customer_expectations_name_each_corruption(answer: str, expected: list[str] | None) -> None:
    problems = violations(reference_expectations(), answer)
    if expected is not None:
        assert problems == expected
    else:
        assert problems, f"{answer!r} must violate the customer's expectations"


def test_old_replica_count_and_missing_object_are_explained() -> None:
    assert violations(
        reference_expectations(), '{"region": "us-west", "replica_count": 2, "max_batch_size": 16}'
    ) == [
        "the JSON object holds no value 4",
        "the JSON object holds the excluded value 2",
    ]
    assert violations(reference_expectations(), "The region is us-west.") == [
        "no JSON object in the answer 'The region is us-west.'",
        'no JSON object to find "us-west", 4, 16 in',
    ]


def test_text_after_the_object_and_a_second_object_are_violations() -> None:
    assert JsonObjectOnly().check(CORRECT + " Done.") == ["text after the JSON object: 'Done.'"]
    assert JsonObjectOnly().check(CORRECT + "\n" + CORRECT) == [f"text after the JSON object: {CORRECT!r}"]


def test_json_object_is_found_after_stray_braces() -> None:
    found = find_json_object('see {this} then {"a": 1}')
    assert found is not None
    assert found[0] == {"a": 1}


def test_values_are_a_multiset() -> None:
    check = JsonValuesInclude(values=[4, 4])
    assert check.check('{"a": 4, "b": "4"}') == []
    assert check.check('{"a": 4, "b": 5}') == ["the JSON object holds 4 1x, expected 2x"]


def test_numbers_match_numbers_and_numeric_strings_only() -> None:
    assert canonical(4) == canonical("4") == canonical(4.0) == canonical(" 4 ")
    assert canonical(True) != canonical(1)
    assert canonical("4 replicas") != canonical(4)
    assert canonical("US-West") == canonical("us-west")


def test_json_field_equals_matches_keys_loosely_and_reports_every_mismatch() -> None:
    check = JsonFieldEquals(field="replica count", value=4)
    assert check.check('{"replicaCount": "4"}') == []
    assert check.check('{"replica_count": 4, "previous_replica_count": 2}') == [
        "the JSON field 'previous_replica_count' is 2, expected 4"
    ]
    assert check.check('{"region": "us-west"}') == [
        "the JSON object has no field named like 'replica count' (keys: ['region'])"
    ]


def test_substring_checks() -> None:
    assert Contains(text="US-WEST").check(CORRECT) == []
    assert Contains(text="US-WEST", case_sensitive=True).check(CORRECT) == [
        "the answer does not contain 'US-WEST'"
    ]
    assert NotContains(text="us-east").check(CORRECT) == []
    assert NotContains(text="us-west").check(CORRECT) == ["the answer contains 'us-west'"]
    assert JsonValuesExclude(values=["x"]).check("no object") == []


def test_expectations_load_from_yaml_as_users_write_them() -> None:
    document = yaml.safe_load(
        """
        - kind: json_object_only
        - kind: json_values_include
          values: [us-west, 4, 16]
        - kind: json_field_equals
          field: batch
          value: 16
        - kind: not_contains
          text: us-east
        """
    )
    loaded = TypeAdapter(list[Expectation]).validate_python(document)
    assert [type(check) for check in loaded] == [
        JsonObjectOnly,
        JsonValuesInclude,
        JsonFieldEquals,
        NotContains,
    ]
    assert violations(loaded, CORRECT) == []


@pytest.mark.parametrize(
    "document",
    [
        [{"kind": "json_values_includes", "values": [1]}],
        [{"kind": "contains"}],
        [{"kind": "contains", "text": ""}],
    ],
)
def test_bad_expectations_are_refused(document: object) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(list[Expectation]).validate_python(document)


def test_expectations_describe_themselves() -> None:
    assert [check.describe() for check in reference_expectations()] == [
        "the answer is one JSON object with nothing before or after it",
        'the JSON object\'s values include "us-west", 4, 16',
        'the JSON object\'s values include none of "us-east", 2, 8',
    ]


# --- repeated keys, reasoning, the suite's checks -----------------------------------------------------


def test_a_repeated_key_is_a_violation_and_its_shadowed_value_is_seen() -> None:
    """Class 7: `"region": "us-east", "region": "us-west"` reads as us-west to a parser."""
    answer = '{"region": "us-east", "region": "us-west", "replica_count": 4, "max_batch_size": 16}'
    assert violations([JsonObjectOnly()], answer) == [
        'the JSON object repeats the key \'region\' ("us-east", "us-west"): a superseded value may hide '
        "behind the last one"
    ]
    assert 'the JSON object holds the excluded value "us-east"' in violations(
        reference_expectations(), answer
    )


def test_a_repeated_key_anywhere_inside_is_a_violation_once_per_key() -> None:
    answer = '{"deployment": {"batch": 8, "batch": 16, "batch": 16}, "region": "us-west"}'
    [problem] = violations([JsonValuesInclude(values=["us-west"])], answer)
    assert problem.startswith("the JSON object repeats the key 'batch' (8, 16, 16)")


def test_repeated_keys_are_not_judged_without_a_json_check() -> None:
    answer = '{"a": 1, "a": 2}'
    assert violations([Contains(text="a")], answer) == []
    assert violations([], answer) == []


@pytest.mark.parametrize(
    ("content", "reasoning", "judged"),
    [
        (CORRECT, None, CORRECT),
        # Without a reasoning parser: the content after the end of the reasoning, which names us-east.
        (f"us-east was superseded</think>\n\n{CORRECT}", None, f"\n\n{CORRECT}"),
        # With one: vLLM split it off.
        (CORRECT, "us-east was superseded", CORRECT),
    ],
)
def test_checks_judge_the_answer_after_the_reasoning(
    content: str, reasoning: str | None, judged: str
) -> None:
    from mooncake_operator.canary.expectations import answer_text

    assert answer_text(content, reasoning) == judged
    assert violations(reference_expectations(), answer_text(content, reasoning)) == []
    if reasoning is None and "</think>" in content:
        assert violations(reference_expectations(), content)  # the whole content would fail


def test_a_reasoning_answer_that_stopped_after_its_reasoning_has_no_answer() -> None:
    from mooncake_operator.canary.expectations import answer_text

    assert answer_text(None, "thinking") == ""
    assert violations([JsonObjectOnly()], answer_text(None, "thinking")) == [
        "no JSON object in the answer ''"
    ]


def test_the_value_agnostic_checks_are_the_json_shape() -> None:
    from mooncake_operator.canary.expectations import value_agnostic

    assert value_agnostic(reference_expectations()) == [JsonObjectOnly()]
    assert value_agnostic([Contains(text="x"), JsonValuesInclude(values=[1])]) == []
