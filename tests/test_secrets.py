"""shared/secrets.py: which jobEnvs are secrets, and masking their values in output."""

from __future__ import annotations

import pytest

from muster.shared.secrets import MASK, Masker, is_secret, mask, patterns, redact_env, secret_values

SECRET_NAMES = (
    "HF_TOKEN hf_token DB_PASSWORD MYSQL_PASSWD CLIENT_SECRET AWS_SECRET_ACCESS_KEY API_KEY KeyFile"
)


@pytest.mark.parametrize("name", [*SECRET_NAMES.split(), "GOOGLE_APPLICATION_CREDENTIALS"])
def test_names_that_look_secret_are_secret(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", ["EPOCHS", "LR", "PATH", "DATA", "BATCH_SIZE", "MODEL"])
def test_ordinary_names_are_not(name):
    assert not is_secret(name)


def test_the_patterns_are_configurable(monkeypatch):
    monkeypatch.setenv("MUSTER_SECRET_ENV", " *_PRIVATE , wandb* ")
    assert patterns() == ["*_PRIVATE", "WANDB*"]
    assert is_secret("ssh_private") and is_secret("WANDB_API")
    assert not is_secret("HF_TOKEN")  # the defaults are replaced, not added to


def test_redact_env_hides_only_secret_values():
    env = {"EPOCHS": 3, "HF_TOKEN": "hf_abcdef", "API_KEY": ""}
    assert redact_env(env) == {"EPOCHS": 3, "HF_TOKEN": MASK, "API_KEY": MASK}
    assert env["HF_TOKEN"] == "hf_abcdef"  # a copy


def test_secret_values_are_the_long_enough_ones_longest_first():
    env = {"A_TOKEN": "abcd", "B_TOKEN": "abcdefgh", "SHORT_KEY": "xyz", "EPOCHS": "123456", "N_KEY": None}
    assert secret_values(env) == ["abcdefgh", "abcd"]


def test_a_value_of_several_lines_is_masked_line_by_line():
    pem = "-----BEGIN KEY-----\nMIIEvQIBADANBgkq\n-----END KEY-----\n"
    values = secret_values({"SSH_KEY": pem})
    assert "MIIEvQIBADANBgkq" in values and pem in values
    assert Masker(values)("MIIEvQIBADANBgkq") == MASK


def test_mask_replaces_every_occurrence_longest_first():
    values = secret_values({"A_TOKEN": "s3cr", "B_TOKEN": "s3cr3t-longer"})
    assert mask("x s3cr3t-longer y s3cr z s3cr", values) == "x *** y *** z ***"


def test_short_values_are_not_masked():
    # A one-letter secret would mask every word containing that letter.
    m = Masker(["a", "ab", "abc"])
    assert m("a cab abc") == "a cab abc"


def test_a_masker_for_an_env_masks_its_secrets_only():
    m = Masker.for_env({"HF_TOKEN": "hf_ZZZZ", "EPOCHS": "hf_EPOCH"})
    assert m("token=hf_ZZZZ epochs=hf_EPOCH") == "token=*** epochs=hf_EPOCH"
    assert Masker.for_env({})("anything") == "anything"


def test_a_non_string_value_is_masked_as_the_task_sees_it():
    values = secret_values({"API_KEY": {"id": "abc", "key": 12345}, "PIN_PASSWORD": 987654})
    assert '{"id": "abc", "key": 12345}' in values and "987654" in values


def test_a_code_sync_urls_credentials_are_kept_apart_with_the_secret_envs_and_put_back():
    from muster.shared.jobconfig import JobConfig, has_secrets, split_secrets, with_secrets

    url = "https://bot:tok-123456@git.example.com/team/model.git"
    config = JobConfig.model_validate(
        {
            "jobName": "j",
            "image": "img",
            "jobEnvs": {"API_TOKEN": "tok-abcdef", "PLAIN": "p"},
            "codeSync": {"git": url, "branch": "main"},
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": 128,
                    "gpuNumber": 0,
                    "command": "x",
                },
            ],
        }
    )
    shown, hidden = split_secrets(config)
    assert shown.codeSync is not None and shown.codeSync.git == "https://***@git.example.com/team/model.git"
    assert shown.jobEnvs == {"API_TOKEN": "***", "PLAIN": "p"} and has_secrets(shown)
    assert "tok-123456" not in shown.model_dump_json() and "tok-abcdef" not in shown.model_dump_json()
    assert with_secrets(shown, hidden) == config
    plain = config.model_copy(
        update={
            "jobEnvs": {},
            "codeSync": config.codeSync.model_copy(update={"git": "ssh://git.example.com/x"}),
        }
    )  # type: ignore[union-attr]
    assert split_secrets(plain) == (plain, {}) and not has_secrets(plain)


def test_a_name_the_validator_kept_apart_is_masked_whatever_this_processs_patterns(monkeypatch):
    """MUSTER_SECRET_ENV set on the validator (`*_URL`) and not on the agents: the value the
    validator kept out of the job record was printed in clear in the task's logs, its
    last_lines and its end's reason. The order names what was kept apart; the agent masks both."""
    monkeypatch.delenv("MUSTER_SECRET_ENV", raising=False)
    env = {"DB_URL": "postgres://u:pw@db", "EPOCHS": "123456"}
    assert Masker.for_env(env)("connecting to postgres://u:pw@db") == "connecting to postgres://u:pw@db"
    assert Masker.for_env(env, ["DB_URL"])("connecting to postgres://u:pw@db") == f"connecting to {MASK}"
