"""scripts/check_space.py: `make` refuses to start an environment's build the disk cannot hold, in one line, and
never for one already built."""
from scripts.check_space import check, main, needed_gb

GB = 10**9


def test_a_built_environment_needs_nothing_and_a_missing_one_its_size_and_pip_s_unpacking(tmp_path):
    venv, vllm = tmp_path / ".venv", tmp_path / ".venv-vllm"
    both = needed_gb([venv, vllm])
    assert both > 7.2  # the two measured sizes, before pip's temporary copies
    (venv).mkdir()
    (venv / ".installed").touch()
    assert needed_gb([venv, vllm]) < both
    (vllm).mkdir()
    (vllm / ".installed").touch()
    assert needed_gb([venv, vllm]) == 0
    assert check([venv, vllm], free_bytes=0) is None


def test_a_short_disk_is_named_with_both_numbers_and_what_to_do(tmp_path):
    venv, vllm = tmp_path / ".venv", tmp_path / ".venv-vllm"
    message = check([venv, vllm], free_bytes=int(7.3 * GB))  # the CI run that failed mid-install had 7.3 GB
    assert message is not None
    assert ".venv, .venv-vllm" in message and "7.3 GB free" in message
    assert f"{needed_gb([venv, vllm]):.1f} GB" in message
    assert check([venv, vllm], free_bytes=int(needed_gb([venv, vllm]) * GB) + 1) is None


def test_the_command_exits_2_on_a_short_disk_unless_told_to_skip(tmp_path, monkeypatch, capsys):
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100 * GB, 99 * GB, 1 * GB))
    args = [str(tmp_path / "new" / ".venv")]  # its folder not made yet: the space is counted where it will be
    assert main(args) == 2
    assert "not enough disk for .venv" in capsys.readouterr().err
    monkeypatch.setenv("DRAFTWISE_SKIP_SPACE_CHECK", "1")
    assert main(args) == 0
    assert main([]) == 2
