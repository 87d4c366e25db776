"""Library messages name settings as keywords; the command line names them as flags."""

import pytest

from moespec.cli import main
from moespec.errors import SettingError, cli_message, setting
from moespec.files import OutputExistsError, check_writable


def test_a_setting_reads_as_a_keyword_in_the_library_and_a_flag_on_the_cli():
    error = SettingError(f"pass {setting('truncate', 'left')} or {setting('force', True)}")
    assert str(error) == "pass truncate='left' or force=True"
    assert cli_message(error) == "pass --truncate left or --force"
    assert cli_message(SettingError(f"{setting('max_draft_length')} is 0")) == (
        "--max-draft-length is 0"
    )
    assert cli_message(ValueError("plain")) == "plain"


def test_an_existing_output_names_force_by_the_callers_word(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("{}")
    with pytest.raises(OutputExistsError) as info:
        check_writable(path, force=False)
    assert "pass force=True" in str(info.value) and "--" not in str(info.value)
    assert "pass --force to overwrite it" in cli_message(info.value)


def test_the_cli_prints_the_flag_form(tmp_path, capsys):
    out = tmp_path / "stairs.json"
    out.write_text("{}")
    code = main(["staircase", "--json", "--plot", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--force" in err and "force=True" not in err


def test_no_library_message_names_a_flag():
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "moespec"
    quoted_flag = re.compile(r"""f?["'][^"'\n]*(?<![\w-])--[a-z][a-z-]+""")
    offenders = []
    for path in package.rglob("*.py"):
        if path.parts[-2] == "cli":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if quoted_flag.search(code) and '"""' not in code:
                offenders.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    # the markers themselves, git's own flags, a "--" table cell, the commands behind results
    # llamacpp_plan.py writes llama.cpp's own command line (its flags, not moespec's), and
    # export/speculative.py SGLang's and llama.cpp's;
    # kernels/native.py asks the C compiler its version (the compiler's flag);
    # models/converted.py names the command line that converts a directory again
    allowed = {
        "models/converted.py",
        "kernels/native.py",
        "errors.py",
        "provenance.py",
        "report/reuse.py",
        "bench/results.py",
        "calibrate/llamacpp_plan.py",
        "export/speculative.py",
    }
    offenders = [o for o in offenders if o.split(":")[0] not in allowed]
    assert not offenders, "\n".join(offenders)
