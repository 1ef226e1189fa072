"""The math task end to end from files read through `datasets`: parquet, the Hub's split layout,
GSM8K and MATH answer formats, column and split options, and the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("datasets")

from echo2swarm.models.tiny import build_char_tokenizer  # noqa: E402
from echo2swarm.tasks import MathTask, get_task  # noqa: E402
from echo2swarm.tasks.math import sample_path  # noqa: E402
from echo2swarm.tasks.problems import final_answer  # noqa: E402

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "A shop sells 4 boxes of 250 pens. How many pens is that?", "answer": "4 * 250 = 1000 pens.\n#### 1,000"},
    {"question": "What is 7*8?", "answer": "#### 56"},
    {"question": "Half of 7?", "answer": "7/2 = 3.5\n#### 3.5"},
]
MATH = [
    {"problem": "Simplify \\frac{10}{4}.", "solution": "Divide by 2: $\\boxed{\\frac{5}{2}}$."},
    {"problem": "What is $\\sqrt{16}$?", "solution": "It is $\\boxed{4}$."},
]


def _parquet(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [("so #### 72", "72"), ("#### 1,000", "1000"), ("#### 1,234,567", "1234567"), ("#### -3.5\nthanks", "-3.5"),
     ("\\boxed{5} then #### 6", "6"), ("#### 6 then \\boxed{5}", "5"), ("plain 7", None), ("####", None)],
)
def test_final_answer_markers(text: str, expected: str | None) -> None:
    assert final_answer(text) == expected


def test_gsm8k_parquet_end_to_end(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "gsm8k.parquet", GSM8K)
    task = MathTask(path, eval_fraction=0.25, prompt_template="Q: {question}\nA:", cache_dir=tmp_path / "cache")
    assert [p.answer for p in task.problems] == ["72", "1000", "56", "3.5"]
    assert task.eval_size() == 1 and sorted(task.answer(i) for i in range(3)) != []
    questions = {p.question: p.answer for p in task.problems}
    prompts = [task.prompt(i) for i in range(3)] + [task.prompt(0, "eval")]
    assert {p.text.removeprefix("Q: ").removesuffix("\nA:") for p in prompts} == set(questions)
    # Grade every prompt by its own id, with right and wrong answers in GSM8K's and LaTeX's forms.
    for p in prompts:
        split, index = p.prompt_id.split(":")
        answer = task.answer(int(index), split)
        for right in (f"... so #### {answer}", f"The answer is \\boxed{{{answer}}}.", f"{answer}"):
            assert task.reward(p.prompt_id, right, finished=True) == 1.0, (right, answer)
        for wrong in (f"#### {answer}9", "\\boxed{0}", "no idea", f"#### {answer} wait, \\boxed{{{answer}1}}"):
            assert task.reward(p.prompt_id, wrong, finished=True) == 0.0, (wrong, answer)
        assert task.reward(p.prompt_id, f"#### {answer}", finished=False) == 0.0  # cut at the token limit
    pens = next(p for p in prompts if "pens" in p.text).prompt_id
    assert task.reward(pens, "#### 1,000", finished=True) == 1.0
    assert task.reward(pens, "#### 1000.0", finished=True) == 1.0


def test_math_style_parquet_and_named_columns(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "math.parquet", MATH)
    task = MathTask(path, eval_fraction=0.0)
    assert [p.answer for p in task.problems] == ["\\frac{5}{2}", "4"]
    pid = next(task.prompt(i).prompt_id for i in range(2) if "Simplify" in task.prompt(i).text)
    assert task.reward(pid, "so it is $\\boxed{2.5}$", finished=True) == 1.0
    assert task.reward(pid, "\\boxed{\\frac{5}{3}}", finished=True) == 0.0

    renamed = _parquet(tmp_path / "renamed.parquet", [{"q": r["question"], "a": r["answer"]} for r in GSM8K])
    task = get_task("math", path=str(renamed), question_field="q", answer_field="a", eval_fraction=0.0)
    assert [task.answer(i) for i in range(4)] != [] and {p.answer for p in task.problems} == {"72", "1000", "56", "3.5"}
    with pytest.raises(ValueError, match=r"question_field = 'question'.*no such column.*\['q', 'a'\]"):
        MathTask(renamed, question_field="question")
    with pytest.raises(ValueError, match=r"none of the columns \['question', 'problem'\].*set question_field"):
        MathTask(renamed)


def test_hub_layout_folder_with_train_and_test_splits(tmp_path: Path) -> None:
    # How a dataset downloaded from the Hub sits on disk: one folder, files named by split.
    folder = tmp_path / "gsm8k" / "main"
    _parquet(folder / "train-00000-of-00001.parquet", GSM8K[:3])
    _parquet(folder / "test-00000-of-00001.parquet", GSM8K[3:])
    task = MathTask(folder, eval_split="test", cache_dir=tmp_path / "cache")
    assert task.eval_size() == 1 and task.answer(0, "eval") == "3.5"
    assert {task.answer(i) for i in range(3)} == {"72", "1000", "56"}
    assert task.reward(task.prompt(0, "eval").prompt_id, "#### 3.5", finished=True) == 1.0
    with pytest.raises(ValueError, match=r"split = 'validation'.*\['test', 'train'\]"):
        MathTask(folder, eval_split="validation", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="eval_fraction or eval_split, not both"):
        MathTask(folder, eval_split="test", eval_fraction=0.1)
    with pytest.raises(ValueError, match="eval_split = 'train' is the training split"):
        MathTask(folder, eval_split="train")
    with pytest.raises(ValueError, match="split = 'test'.*one split, 'train'"):
        MathTask(_parquet(tmp_path / "one.parquet", GSM8K), split="test")


_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}")


def _tokenizer_dir(path: Path, template: str | None, adds_bos: bool = False) -> Path:
    from tokenizers import processors

    tokenizer = build_char_tokenizer()
    if adds_bos:  # Llama-style: plain encoding starts with BOS
        tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tokenizer.bos_token_id)])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def test_chat_template_applied_when_the_tokenizer_has_one(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = _tokenizer_dir(tmp_path / "model", _TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = MathTask(sample_path(), tokenizer=str(model_dir), system_prompt="be brief.")
    plain = MathTask(sample_path())
    question = plain.prompt(3).text
    text = task.prompt(3).text
    assert text == f"system: be brief.\nuser: {question}\nassistant:"
    # The learner and rollout engines encode prompt text with tokenizer(text): the same ids the
    # template's own tokenisation gives.
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": question}]
    templated = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert tokenizer(text)["input_ids"] == list(templated["input_ids"] if isinstance(templated, Mapping) else templated)
    # Grading is unchanged by the format.
    answer = task.answer(3)
    assert task.reward(task.prompt(3).prompt_id, f"\\boxed{{{answer}}}", finished=True) == 1.0

    assert MathTask(sample_path(), tokenizer=str(model_dir), chat_template=False).prompt(3).text == question
    bare = _tokenizer_dir(tmp_path / "bare", None)
    assert MathTask(sample_path(), tokenizer=str(bare)).prompt(3).text == question  # no template: plain
    with pytest.raises(ValueError, match="chat_template = true.*no chat template"):
        MathTask(sample_path(), tokenizer=str(bare), chat_template=True)
    with pytest.raises(ValueError, match="need the tokenizer option"):
        MathTask(sample_path(), chat_template=True)
    with pytest.raises(ValueError, match="system_prompt needs a chat template"):
        MathTask(sample_path(), tokenizer=str(bare), system_prompt="hi")
    with pytest.raises(ValueError, match="tokenizer = .*nowhere.*not a directory"):
        MathTask(sample_path(), tokenizer=str(tmp_path / "nowhere"))


def test_chat_template_bos_is_not_doubled(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = _tokenizer_dir(tmp_path / "model", "{{ bos_token }}" + _TEMPLATE, adds_bos=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = MathTask(sample_path(), tokenizer=str(model_dir))
    text = task.prompt(0).text
    assert not text.startswith("<bos>")
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
