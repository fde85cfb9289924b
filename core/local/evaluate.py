"""`asyncrl eval`: a model scored on a job's evaluation prompts with the job's reward, by the
trainer's own generate-and-score code (asyncrl.evaluation), and the result as JSON and a
Markdown table.

One response per prompt is greedy (pass@1, what the trainer's evaluation reports); k > 1
responses are sampled at the job's rollout settings: pass@1 is then their mean, pass@k the
unbiased estimate, and maj@k (math rewards only) scores the answer most responses give.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.algorithms.evaluation import accuracy_record, majority_score, pass_at_k
from asyncrl.clients.reward import reward_scorer
from asyncrl.data.prompts import PromptItem
from asyncrl.evaluation import (
    evaluation_dtype,
    evaluation_engine,
    generate,
    job_scorer,
    response_record,
    sampling,
    score,
)
from asyncrl.local.eval_models import EvalModel
from asyncrl.model.policy import load_policy
from asyncrl.scoring.extract import extract_answer
from asyncrl.spec.job import DatasetSpec

#: A response counts as solving its problem (for pass@k) at the reward's full score.
SOLVED = 1.0


def prompts_file_spec(spec, path: Path):
    """`spec` with its evaluation prompts read from `path`: through the job's own mapping for a
    file dataset, else rows with `prompt` and `answer` (math) or `tests` (code)."""
    dataset = spec.dataset
    if dataset.kind == "file":
        changed = dataset.model_copy(update={"eval_path": str(path)})
    else:
        reference = "tests" if spec.reference_reward == "code" else "answer"
        changed = DatasetSpec.model_validate({
            "kind": "file", "path": str(path), "eval_path": str(path),
            "fields": {"prompt": "prompt", reference: reference},
            "system_prompt": dataset.system_prompt})
    return spec.model_copy(update={"dataset": changed})


def evaluate_model(spec, job_name: str, model: EvalModel, items: list[PromptItem], tokenizer,
                   *, samples: int, device, on_done: Callable[[], None] | None = None) -> dict:
    """The scores of `model` on `items`, `samples` responses each, as a JSON-ready record."""
    started = time.perf_counter()
    engine_spec = spec.model_copy(update={"model": model.model_spec})
    dtype = evaluation_dtype(engine_spec, device)
    loaded, _ = load_policy(model.model_spec, dtype=dtype, device=device)
    engine = evaluation_engine(loaded, engine_spec, items, tokenizer, samples=samples)
    try:
        state = model.state(loaded)
        if state is not None:
            engine.update_weights_from_state_dict(state, model.step or 1)
        results = generate(engine, items, sampling(spec, samples), samples=samples,
                           on_done=on_done)
    finally:
        engine.stop()
    scores = asyncio.run(_scored(spec, job_name, tokenizer, items, results))
    texts = [[tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in group]
             for group in results]
    record = {"model": model.label, "resolved": model.where, "step": model.step,
              "samples": samples, "problems": len(items), "dtype": dtype,
              **_metrics(spec, scores, texts, samples),
              **{key.removeprefix("eval_"): value
                 for key, value in response_record(results).items()},
              "seconds": round(time.perf_counter() - started, 2)}
    record["per_problem"] = [
        {"prompt_id": item.prompt_id, "scores": s, "responses": t,
         "cut": [r.finish_reason == "length" for r in group]}
        for item, s, t, group in zip(items, scores, texts, results)]
    return record


async def _scored(spec, job_name, tokenizer, items, results) -> list[list[float]]:
    reward = reward_scorer(None, job_name, spec.reward)
    try:
        return await score(job_scorer(reward, spec, tokenizer), items, results)
    finally:
        await reward.close()


def _metrics(spec, scores: list[list[float]], texts: list[list[str]], samples: int) -> dict:
    mean = [sum(s) / len(s) for s in scores]
    accuracy = accuracy_record(mean)
    metrics = {"pass@1": accuracy["eval_accuracy"], "pass@1_stderr": accuracy["eval_stderr"]}
    if samples > 1:
        solved = [sum(score >= SOLVED for score in s) for s in scores]
        metrics[f"pass@{samples}"] = sum(pass_at_k(samples, c, samples)
                                         for c in solved) / len(solved)
        if spec.reward.kind == "math":
            rules = spec.reward.math.extract
            metrics[f"maj@{samples}"] = sum(
                majority_score([extract_answer(t, rules) for t in group], s)
                for group, s in zip(texts, scores)) / len(scores)
    return metrics


def majority_note(spec, samples: int) -> str | None:
    """Why maj@k is left out, where it is."""
    if samples > 1 and spec.reward.kind != "math":
        return (f"maj@{samples} is left out: a {spec.reward.kind} reward has no answer to "
                "vote on (it applies to math rewards)")
    return None


def markdown_table(job_name: str, records: list[dict], prompts: str) -> str:
    """The models side by side: one row per metric, one column per model."""
    keys = [k for k in records[0] if k.startswith(("pass@", "maj@")) and "stderr" not in k]
    header = "| metric | " + " | ".join(f"`{r['model']}`" for r in records) + " |"
    lines = [f"# {job_name}: evaluation on {prompts}", "", header,
             "|---" * (len(records) + 1) + "|"]
    for key in keys:
        cells = []
        for record in records:
            cell = f"{100 * record[key]:.1f}%"
            if key == "pass@1":
                cell += f" ± {100 * record['pass@1_stderr']:.1f}"
            cells.append(cell)
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| problems | " + " | ".join(str(r["problems"]) for r in records) + " |")
    lines += ["", *(f"- `{r['model']}`: {r['resolved']}" for r in records), ""]
    return "\n".join(lines)


def write_results(out: Path, job_name: str, records: list[dict], prompts: str) -> tuple[Path, Path]:
    """JSON (every response and score) and the Markdown table, named after the models."""
    out.mkdir(parents=True, exist_ok=True)
    name = "_vs_".join(_slug(r["model"]) for r in records) + f"-k{records[0]['samples']}"
    json_path, table_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps({"job": job_name, "prompts": prompts, "models": records},
                                    indent=1))
    table_path.write_text(markdown_table(job_name, records, prompts))
    return json_path, table_path


def default_out(job_name: str, model: EvalModel) -> Path:
    """Beside the first model: RUN_DIR/eval for a run or its checkpoint, FOLDER-eval beside
    any other folder, runs/<job>/eval for the base model."""
    if model.weights is not None and model.weights.parent.name == "checkpoints":
        return model.weights.parent.parent / "eval"
    if model.label != "base":
        folder = Path(model.label.split("@")[0]).expanduser()
        return folder.parent / f"{folder.name}-eval"
    return Path("runs") / job_name / "eval"


def _slug(text: str) -> str:
    path = Path(text.split("@")[0])
    base = path.name if text != "base" else "base"
    step = text.split("@")[1] if "@" in text else None
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base + (f"-step{step}" if step else ""))
