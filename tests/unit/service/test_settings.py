"""Settings: tokens from mounted secrets, short tokens refused, misspelt variables named."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import Settings, unknown_variables

TOKEN = "a-token-of-twenty-chars"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("TG_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("kind", ["api", "admin"])
def test_a_token_file_is_read_and_stripped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    secret = tmp_path / "token"
    secret.write_text(f"  {TOKEN}\n")
    monkeypatch.setenv(f"TG_{kind.upper()}_TOKEN_FILE", str(secret))
    assert getattr(Settings(), f"{kind}_token") == TOKEN


def test_a_token_and_its_file_together_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "token"
    secret.write_text(TOKEN)
    monkeypatch.setenv("TG_API_TOKEN", TOKEN)
    monkeypatch.setenv("TG_API_TOKEN_FILE", str(secret))
    with pytest.raises(ValidationError, match="set TG_API_TOKEN or TG_API_TOKEN_FILE, not both"):
        Settings()


def test_a_missing_token_file_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TG_ADMIN_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(ValidationError, match=r"TG_ADMIN_TOKEN_FILE: cannot read .*absent"):
        Settings()


@pytest.mark.parametrize("token", ["", " ", "short"])
def test_empty_or_short_tokens_refuse_to_start(monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    monkeypatch.setenv("TG_API_TOKEN", token)
    with pytest.raises(
        ValidationError, match="TG_API_TOKEN is .* characters long; a token needs at least 16"
    ):
        Settings()


def test_an_empty_token_file_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "token"
    secret.write_text("\n")
    monkeypatch.setenv("TG_API_TOKEN_FILE", str(secret))
    with pytest.raises(ValidationError, match="TG_API_TOKEN_FILE .* is 0 characters long"):
        Settings()


def test_unknown_variables_name_the_closest_setting() -> None:
    warnings = unknown_variables(
        {"TG_API_TOKNE": "x", "TG_PORT": "1", "TG_ZZZZZZZZZZ": "y", "PATH": "/bin"}
    )
    assert warnings == [
        "TG_API_TOKNE is not a tensorgate setting and is ignored; did you mean TG_API_TOKEN?",
        "TG_ZZZZZZZZZZ is not a tensorgate setting and is ignored",
    ]


def test_every_setting_is_known() -> None:
    assert unknown_variables({f"TG_{name.upper()}": "" for name in Settings.model_fields}) == []


def test_the_inflight_budget_is_sized_to_the_machine_and_fits_one_largest_body() -> None:
    settings = Settings()
    assert settings.max_body_bytes <= settings.max_inflight_bytes <= 1 << 30
    assert Settings(max_inflight_bytes=123_456_789).max_inflight_bytes == 123_456_789
    with pytest.raises(
        ValidationError, match="TG_MAX_INFLIGHT_BYTES .* is below TG_MAX_BODY_BYTES"
    ):
        Settings(max_inflight_bytes=10, max_body_bytes=100)


def test_one_client_may_hold_half_the_connections_by_default() -> None:
    assert Settings(max_connections=100).max_connections_per_client == 50
    assert Settings(max_connections=1).max_connections_per_client == 1
    assert (
        Settings(max_connections=100, max_connections_per_client=7).max_connections_per_client == 7
    )
    assert (
        Settings(max_connections=10, max_connections_per_client=70).max_connections_per_client == 10
    )


@pytest.mark.parametrize(
    ("given", "models"),
    [
        ("digits", ["digits"]),  # was "Input should be a valid list"
        ("digits, minilm", ["digits", "minilm"]),
        ('["digits", "minilm"]', ["digits", "minilm"]),  # the JSON list it took first
        ("", None),  # set but empty (a compose file's ${TG_MODELS:-}): every model
    ],
)
def test_models_are_named_separated_by_commas_or_as_a_json_list(
    monkeypatch: pytest.MonkeyPatch, given: str, models: list[str] | None
) -> None:
    monkeypatch.setenv("TG_MODELS", given)
    assert Settings().models == models


@pytest.mark.parametrize(
    ("given", "said"), [("digits,,minilm", "an empty model name"), ("[digits", "not a JSON list")]
)
def test_a_bad_model_list_says_what_is_wrong(
    monkeypatch: pytest.MonkeyPatch, given: str, said: str
) -> None:
    monkeypatch.setenv("TG_MODELS", given)
    with pytest.raises(ValidationError, match=said):
        Settings()
