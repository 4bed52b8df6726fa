"""The doc-QA data generator, the shipped doc-QA checkpoint and ``make-model --preset docqa``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modeltools import docqa_data
from modeltools.docqa_data import DocQAExample
from modeltools.docqa_train import answer_ids, check_tokenization, heldout_set, prompt_ids

SHIPPED = Path(__file__).resolve().parents[2] / "modeltools" / "docqa_model"


def test_generator_is_deterministic_and_seeds_differ():
    a = docqa_data.generate(5, 30, (2, 16))
    assert a == docqa_data.generate(5, 30, (2, 16))
    assert a != docqa_data.generate(6, 30, (2, 16))
    assert docqa_data.generate(5, 10, 8, "heldout") == docqa_data.generate(5, 10, 8, "heldout")


def test_format_documents_are_separate_parts_and_the_question_is_last():
    for ex in docqa_data.generate(0, 50, (2, 16)):
        system, user = ex.messages
        assert system == {"role": "system", "content": ex.system}
        assert ex.system in docqa_data.SYSTEM_PROMPTS
        parts = user["content"]
        assert [p["text"] for p in parts] == [*ex.documents, ex.question]
        assert all(p["type"] == "text" for p in parts)
        assert 2 <= ex.num_docs <= 16 and ex.question.startswith("Question: ")
        assert ex.answer in docqa_data.entity_words() and " " not in ex.answer
        assert len(ex.gold) == ex.hops and all(0 <= g < ex.num_docs for g in ex.gold)
        assert ex.answer in ex.documents[ex.gold[-1]]  # the answer is in the last gold doc
    systems = {ex.system for ex in docqa_data.generate(0, 200, 8)}
    assert len(systems) == len(docqa_data.SYSTEM_PROMPTS) >= 4


def test_gold_documents_sit_at_every_position():
    examples = docqa_data.generate(1, 400, 8, hops=1)
    assert {ex.gold[0] for ex in examples} == set(range(8))


def test_two_hop_questions_link_two_documents():
    for ex in docqa_data.generate(2, 100, 8, hops=2):
        link, target = (ex.documents[i] for i in ex.gold)
        assert ex.gold[0] != ex.gold[1] and ex.kind in docqa_data.TWO_HOP
        bridge = ex.combo[2]  # the entity the link document names
        assert bridge in link and bridge in target and bridge not in ex.question
        subject = ex.combo[1]
        assert subject in link and subject in ex.question
        assert ex.answer in target
        # the answer is only the final entity
        assert ex.answer != bridge


def test_every_subject_has_at_most_one_document():
    for ex in docqa_data.generate(3, 100, 16):
        subjects = [
            d.split(": ", 1)[1].split(" ")[0 if d.startswith("Staff") else 1] for d in ex.documents
        ]
        assert len(subjects) == len(set(subjects))


def test_heldout_is_disjoint_from_training():
    train = docqa_data.generate(0, 500, (2, 16), "train")
    held = docqa_data.generate(0, 200, 8, "heldout")
    assert not any(docqa_data.is_heldout(ex.combo) for ex in train)
    assert all(docqa_data.is_heldout(ex.combo) for ex in held)
    assert not {ex.combo for ex in train} & {ex.combo for ex in held}


@pytest.fixture(scope="module")
def shipped_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED)


def test_training_tokenization_is_the_engines(shipped_tokenizer):
    examples = docqa_data.generate(4, 20, (2, 16))
    check_tokenization(shipped_tokenizer, examples)  # raises on any difference
    end = shipped_tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen_config = json.loads((SHIPPED / "generation_config.json").read_text())
    assert end in gen_config["eos_token_id"]
    from modeltools.docqa_train import _batch_ids

    assert _batch_ids(shipped_tokenizer, examples) == [
        [(prompt_ids(shipped_tokenizer, ex), False), (answer_ids(shipped_tokenizer, ex), True)]
        for ex in examples
    ]  # the trainer's one-call batch tokenization
    for ex in examples:
        ids = answer_ids(shipped_tokenizer, ex)
        assert ids[-1] == end and len(ids) == 2  # one entity token, then end of turn
        # the reply is the token the documents hold (" Oslo"), not a token of its own
        assert ids[0] in prompt_ids(shipped_tokenizer, ex)
        assert answer_ids(shipped_tokenizer, ex, answer_space=False)[0] not in ids
        rendered = shipped_tokenizer.apply_chat_template(
            [*ex.messages, {"role": "assistant", "content": " " + ex.answer}], tokenize=False
        )
        assert rendered.endswith(f"<|im_start|>assistant\n {ex.answer}<|im_end|>\n")
    check_tokenization(shipped_tokenizer, examples, answer_space=False)  # the older form


def test_shipped_checkpoint_is_small_and_loads_in_transformers():
    from transformers import AutoModelForCausalLM

    size = sum(p.stat().st_size for p in SHIPPED.iterdir())
    assert size <= 16 * 2**20
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def shipped_llm():
    from workers import LLM

    return LLM(str(SHIPPED), page_size=16, max_model_len=2048)


def test_engine_matches_transformers_on_a_docqa_prompt(shipped_llm, hf_reference):
    from tests.workers.reference import reference_greedy, reference_logits
    from workers import SamplingParams

    ref = hf_reference(SHIPPED)
    for ex in heldout_set(11, 4, 8):
        prompt = shipped_llm.chat_tokens(ex.messages)
        out = shipped_llm.generate(
            [prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
        )[0]
        assert list(out.token_ids) == reference_greedy(ref, prompt, 4)
        expected = torch.log_softmax(reference_logits(ref, prompt)[-1], -1)
        for token, logprob in out.logprobs[0]:
            assert abs(logprob - expected[token].item()) < 1e-3


def test_shipped_model_answers_heldout_questions(shipped_llm):
    """Greedy exact match through the engine, held-out questions at 4, 8 and 16
    documents, half of them two-hop: the shipped model answers all 2,000 + 2 x 1,000 of
    its final evaluation (transformers, bf16) right; a miss or two here would be news."""
    from workers import SamplingParams

    examples: list[DocQAExample] = [ex for n in (4, 8, 16) for ex in heldout_set(21 + n, 12, n)]
    outs = shipped_llm.chat(
        [ex.messages for ex in examples], SamplingParams(max_tokens=6, temperature=0)
    )
    correct = [
        docqa_data.answer_matches(o.text, ex.answer) and o.finish_reason == "stop"
        for o, ex in zip(outs, examples, strict=True)
    ]
    assert sum(correct) >= len(examples) - 1, [
        (ex.answer, o.text) for o, ex in zip(outs, examples, strict=True)
    ]
    assert all(
        prompt_ids(shipped_llm.tokenizer, ex) == list(o.prompt_token_ids)
        for o, ex in zip(outs, examples, strict=True)
    )


def test_curriculum_schedule_and_floor():
    from modeltools.docqa_train import TrainConfig, _lr_at, gated_floor, max_docs_at, parse_schedule

    cfg = TrainConfig(steps=1000, curriculum="0:4,100:8,300:16")
    assert parse_schedule(cfg.curriculum) == [(0, 4), (100, 8), (300, 16)]
    assert [max_docs_at(s, cfg) for s in (0, 99, 100, 299, 300, 999)] == [4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError):
        parse_schedule("5:4")
    gated = TrainConfig(curriculum="gated")
    assert gated_floor(0.0, gated) == 4 and gated_floor(0.45, gated) == 4
    assert gated_floor(0.8, gated) == 16 and 4 < gated_floor(0.6, gated) < 16
    wsd = TrainConfig(steps=1000, lr=1e-3, warmup_steps=10, decay_frac=0.2, lr_schedule="wsd")
    assert _lr_at(500, wsd) == 1e-3 and _lr_at(800, wsd) == 1e-3 and _lr_at(999, wsd) < 1e-4


def test_make_model_docqa_writes_a_loadable_checkpoint(tmp_path, capsys):
    from cluster.ops.cli import main
    from workers import LLM, SamplingParams

    out = tmp_path / "docqa"
    options = ["--preset", "docqa", "--steps", "2", "--batch-size", "2", "--eval-examples", "2",
               "--final-eval-examples", "2", "--device", "cpu", "--turns", "2",
               "--set", "hidden_size=64", "--set", "head_dim=16", "--set", "intermediate_size=128"]  # fmt: skip
    assert main(["make-model", str(out), *options, "--set", "num_hidden_layers=4"]) == 0
    summary = json.loads((out / "training.json").read_text())
    assert summary["steps_done"] == 2 and summary["config"]["batch_size"] == 2
    assert summary["config"]["guide_weight"] > 0 and summary["config"]["answer_space"]
    # the guides need the heads they supervise
    shallow = ["make-model", str(tmp_path / "shallow"), *options, "--set", "num_hidden_layers=3"]
    assert main(shallow) == 2
    assert "at least 4 layers" in capsys.readouterr().err
    llm = LLM(str(out), page_size=16, max_model_len=2048)
    ex = heldout_set(0, 2, 4)[0]
    result = llm.chat(ex.messages, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(result.token_ids) == 2
    assert main(["make-model", str(tmp_path / "x"), "--steps", "2"]) == 2  # needs --preset docqa
    capsys.readouterr()
    assert main(["make-model", str(tmp_path / "y"), *options, "--varied-share", "50"]) == 2
    assert "varied_share is a share of conversations in [0, 1]" in capsys.readouterr().err


def test_docqa_train_takes_every_training_option(tmp_path):
    """``python -m modeltools.docqa_train train``: any ``TrainConfig`` field, here the
    composed phrasings; a bad value is refused."""
    from modeltools.docqa_train import main

    out = tmp_path / "composed"
    options = ["--steps", "1", "--batch-size", "2", "--eval-examples", "2",
               "--final-eval-examples", "2", "--device", "cpu", "--turns", "2",
               "--varied-share", "1", "--varied-templates", "composed", "--answer-space", "true"]  # fmt: skip
    assert main(["train", str(out), "--seed", "3", *options]) == 0
    summary = json.loads((out / "training.json").read_text())
    assert summary["seed"] == 3 and summary["steps_done"] == 1
    assert summary["config"]["varied_templates"] == "composed"
    assert summary["config"]["varied_share"] == 1.0 and summary["config"]["answer_space"] is True
    with pytest.raises(ValueError, match="varied_templates"):
        main(["train", str(tmp_path / "bad"), *options[:-4], "--varied-templates", "heldout"])


def test_both_training_command_lines_take_every_field_alike():
    """``chunkserve make-model --preset docqa`` and ``python -m modeltools.docqa_train
    train`` take every ``TrainConfig`` field but the seed, typed as the field (numbers
    where the default is None, true / false for flags), from one table; an unknown
    truth value is refused."""
    import argparse
    from dataclasses import fields

    from cluster.ops.cli import build_parser
    from modeltools.docqa_config import TrainConfig, add_train_arguments, train_overrides

    given = {"time_budget_s": "12.5", "num_workers": "3", "device": "cpu",
             "init_from": "/ckpt", "reverse": "yes", "json_opening_loss": "true",
             "answer_space": "false"}  # fmt: skip
    expected = {"time_budget_s": 12.5, "num_workers": 3, "device": "cpu",
                "init_from": "/ckpt", "reverse": True, "json_opening_loss": True,
                "answer_space": False}  # fmt: skip
    for f in fields(TrainConfig):
        if f.name not in given and f.name != "seed":
            value = f.default * 2 if not isinstance(f.default, str) else f.default + "x"
            given[f.name], expected[f.name] = str(value), value
    argv = [part for name, text in given.items() for part in ("--" + name.replace("_", "-"), text)]
    cli = build_parser().parse_args(["make-model", "/tmp/docqa", "--preset", "docqa", *argv])
    train = argparse.ArgumentParser()
    add_train_arguments(train)
    assert train_overrides(cli) == train_overrides(train.parse_args(argv)) == expected
    assert set(expected) == {f.name for f in fields(TrainConfig)} - {"seed"}
    with pytest.raises(SystemExit):
        train.parse_args(["--reverse", "maybe"])


def test_follow_ups_are_distinct_questions_of_the_same_split_about_the_same_documents():
    import random

    for split in ("train", "heldout"):
        rng = random.Random(f"follow-ups/{split}")
        for _ in range(200):
            ex = docqa_data.generate_example(rng, rng.randint(2, 16), split, questions=6)
            questions = [ex.question, *(q for q, _ in ex.follow_ups)]
            assert len(questions) == len(set(questions)) and len(ex.follow_ups) <= 5
            kinds = {v: k for k, v in docqa_data.QUESTIONS.items()}
            for question, answer in ex.follow_ups:
                assert question.startswith("Question: ")
                # every answer is an entity the documents name
                assert any(f" {answer}" in d for d in ex.documents)
                assert question[len("Question: ") :] not in kinds  # formatted, not a template
        rng = random.Random(0)
        assert docqa_data.generate_example(rng, 8, split).follow_ups == ()
    with pytest.raises(ValueError, match="hops"):
        docqa_data.generate_example(random.Random(0), 8, "train", 3)


def test_reverse_follow_ups_have_unique_answers_stated_in_one_document():
    import random
    import re

    rng = random.Random(11)
    seen = 0
    for _ in range(300):
        ex = docqa_data.generate_example(
            rng, rng.randint(2, 16), "train", questions=12, reverse=True
        )
        for question, answer in ex.follow_ups:
            m = re.fullmatch(r"Question: Who lives in (\w+)\?", question)
            if m is None:
                continue
            seen += 1
            stating = [d for d in ex.documents if f"lives in {m.group(1)}" in d]
            assert len(stating) == 1 and f" {answer} " in stating[0]
    assert seen > 20
    rng = random.Random(11)
    plain = [docqa_data.generate_example(rng, 8, "train", questions=12) for _ in range(50)]
    assert not any("Who lives in" in q for ex in plain for q, _ in ex.follow_ups)


def test_training_conversations_with_follow_ups_weight_answers_apart(shipped_tokenizer):
    import random

    from modeltools.docqa_train import encode_batch

    rng = random.Random(3)
    examples = [
        docqa_data.generate_example(rng, rng.randint(2, 8), "train", questions=5, reverse=True)
        for _ in range(8)
    ]
    for space in (True, False):  # follow-up turns as the template renders them
        check_tokenization(shipped_tokenizer, examples, space)
    inputs, targets, weights, _ = encode_batch(
        shipped_tokenizer, examples, 2.0, 0.0, answer_space=False
    )
    end = shipped_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, ex in enumerate(examples):
        answered = targets[row][weights[row] > 0].tolist()
        expected = []
        for answer in [ex.answer, *(a for _, a in ex.follow_ups)]:
            expected += shipped_tokenizer.encode(answer, add_special_tokens=False) + [end]
        assert answered == expected  # answers and end tokens only, in order
        assert set(weights[row][weights[row] > 0].tolist()) == {2.0}
    _, _, with_prompt, _ = encode_batch(shipped_tokenizer, examples, 2.0, 0.25)
    assert set(with_prompt.unique().tolist()) == {0.0, 0.25, 2.0}  # padding, prompt, answers


def test_relation_chance_is_one_over_the_values_of_the_asked_relation():
    ex = DocQAExample(
        system="s",
        documents=(
            "Staff note: Mira lives in Oslo and is 34 years old.\n",
            "Staff note: Omar is 40 years old and lives in Lima.\n",
            "Team note: the Falcon team is based in Oslo and is led by Omar.\n",
        ),
        question="Question: Where does Mira live?",
        answer="Oslo",
        hops=1,
        kind="person_city",
        gold=(0,),
        combo=("person_city", "Mira", "Oslo"),
    )
    assert docqa_data.relation_chance(ex) == 0.5  # Oslo or Lima: team bases do not count
    for ex in docqa_data.generate(9, 200, (2, 16), "heldout"):
        assert 0 < docqa_data.relation_chance(ex) <= 1  # the answer is always among them


def _template_of(text: str, templates, subject: str) -> int:
    """Index of the template ``text`` is, with ``subject`` filled in (-1: none)."""
    return next((i for i, t in enumerate(templates) if t.format(s=subject) == text), -1)


def test_varied_questions_use_only_their_template_split():
    from modeltools import docqa_phrasing

    for templates in docqa_phrasing.TEMPLATE_SPLITS:
        for ex in heldout_set(9, 60, 8, "varied", templates):
            question = ex.question
            for prefix in ("Question: ", "Q: "):
                question = question.removeprefix(prefix)
            index = _template_of(question, docqa_phrasing.QUESTIONS[ex.kind], ex.combo[1])
            assert index >= 0, ex.question
            assert (index % 5 == 4) == (templates == "heldout"), (templates, ex.question)


def test_varied_documents_name_one_subject_and_distractors_name_nothing():
    import random

    from modeltools import docqa_phrasing

    names = {*docqa_data.entity_words(), *docqa_phrasing.EXTRA_PEOPLE, *docqa_phrasing.EXTRA_CITIES}
    for sentence in docqa_phrasing.DISTRACTORS:
        words = set(sentence.rstrip(".").split())
        assert not words & names and not any(c.isdigit() for c in sentence), sentence
    rng, extra = random.Random(0), set()
    for _ in range(200):
        ex = docqa_data.generate_example(rng, 8, "train", style="varied")
        assert ex.answer in ex.documents[ex.gold[-1]]
        for doc in ex.documents:
            body = doc.strip()
            for header in filter(None, docqa_phrasing.HEADERS):
                body = body.removeprefix(header)
            facts = [
                s for s in body.rstrip(".").split(". ") if s + "." not in docqa_phrasing.DISTRACTORS
            ]
            subjects = {" ".join(s.split()[: 2 if s.startswith("The ") else 1]) for s in facts}
            assert len(subjects) == 1, doc  # every fact sentence names the one subject
            extra |= set(body.split()) & set(docqa_phrasing.EXTRA_PEOPLE)
    assert extra  # names from outside the plain lists appear


def _heldout_patterns() -> tuple[list, list]:
    """Every held-out template as a regular expression (slots: any text), the fact
    templates to search sentences with, the question templates to match questions."""
    import re

    from modeltools import docqa_phrasing

    def pattern(template: str):
        parts = re.split(r"\{\w\}", template.rstrip("?."))
        return re.compile(".+?".join(re.escape(p) for p in parts), re.IGNORECASE)

    def held(lists):
        return [pattern(t) for ts in lists for i, t in enumerate(ts) if i % 5 == 4]

    facts = held([*docqa_phrasing.PERSON_FACTS.values(), *docqa_phrasing.TEAM_FACTS.values()])
    return facts, held(docqa_phrasing.QUESTIONS.values())


def _composed_conversations(count: int, seed: int = 0) -> list[DocQAExample]:
    import random

    rng = random.Random(f"composed/{seed}")
    return [
        docqa_data.generate_example(
            rng, rng.randint(2, 16), "train", questions=8, style="varied", templates="composed"
        )
        for _ in range(count)
    ]


def _bare(question: str) -> str:
    for prefix in ("Question: ", "Q: "):
        question = question.removeprefix(prefix)
    return question


def test_composed_phrasings_never_produce_a_heldout_template():
    """Training's composed phrasings: no held-out template (fact or question, any
    values), and no word that makes a held-out template a phrasing of its own."""
    from modeltools import docqa_phrasing
    from modeltools.docqa_phrasing import HELDOUT_FACT_WORDS, HELDOUT_QUESTION_WORDS, _words

    assert {"resident", "calls", "stationed"} <= HELDOUT_FACT_WORDS
    assert {"found", "tell", "that"} <= HELDOUT_QUESTION_WORDS
    facts, questions = _heldout_patterns()
    # the checks find what they look for: every held-out template is caught
    for templates in docqa_phrasing.QUESTIONS.values():
        text = templates[4].format(s="Mira")
        assert any(q.fullmatch(text.rstrip("?.")) for q in questions), text
    sentence = docqa_phrasing.PERSON_FACTS["city"][9].format(n="Mira", c="Oslo")
    assert any(f.search(sentence) for f in facts) and _words(sentence) & HELDOUT_FACT_WORDS
    asked, stated = set(), set()
    for ex in _composed_conversations(600):
        for question in [ex.question, *(q for q, _ in ex.follow_ups)]:
            bare = _bare(question)
            asked.add(bare)
            assert not any(q.fullmatch(bare.rstrip("?.")) for q in questions), question
            assert not _words(bare) & HELDOUT_QUESTION_WORDS, question
        for doc in ex.documents:
            stated.add(doc)
            assert not any(f.search(doc) for f in facts), doc
            assert not _words(doc) & HELDOUT_FACT_WORDS, doc
    assert len(asked) > 2000 and len(stated) > 5000  # thousands of phrasings, not eight


def test_composed_documents_state_each_fact_of_one_subject_and_questions_ask_it():
    """Composed documents: every fact sentence names the document's one subject first,
    the answer is stated in the last gold document, and the conversations tokenize as
    the engine renders them; every composed question names its subject."""
    from transformers import AutoTokenizer

    from modeltools import docqa_phrasing

    check_tokenization(AutoTokenizer.from_pretrained(SHIPPED), _composed_conversations(10, 1))
    distractors = {*docqa_phrasing.DISTRACTORS, *docqa_phrasing.EXTRA_DISTRACTORS}
    headers = [h for h in (*docqa_phrasing.HEADERS, *docqa_phrasing.EXTRA_HEADERS) if h]
    for ex in _composed_conversations(300, 2):
        assert ex.answer in ex.documents[ex.gold[-1]]
        assert ex.combo[1] in ex.question
        for doc in ex.documents:
            body = doc.strip()
            for header in headers:
                body = body.removeprefix(header)
            facts = [s for s in body.rstrip(".").split(". ") if s + "." not in distractors]
            assert 1 <= len(facts) <= 2, doc
            first = facts[0].replace("'s ", " ").split()
            subject = " ".join(first[:2]) if first[0] == "The" else first[0]
            assert all(f.replace("'s ", " ").startswith(subject + " ") for f in facts), doc


def test_the_training_stream_composes_phrasings_only_where_asked():
    import random

    from modeltools import docqa_phrasing
    from modeltools.docqa_train import TrainConfig, training_example

    def frames(cfg):
        rng = random.Random(5)
        out = set()
        for _ in range(300):
            ex = training_example(rng, 8, cfg)
            out.add(_bare(ex.question).replace(ex.combo[1], "{s}"))
        return out

    templates = {t for ts in docqa_phrasing.QUESTIONS.values() for t in ts}
    templates |= set(docqa_data.QUESTIONS.values())
    assert frames(TrainConfig(varied_share=0.5)) <= templates
    composed = frames(TrainConfig(varied_share=0.5, varied_templates="composed"))
    assert len(composed - templates) > 50
    # no varied share: the plain stream, whatever the option says
    assert frames(TrainConfig()) == frames(TrainConfig(varied_templates="composed"))


def test_json_replies_tokenize_as_the_engine_renders_them(shipped_tokenizer):
    import random

    rng = random.Random(3)
    examples = [
        docqa_data.generate_example(
            rng, rng.randint(2, 16), "train", questions=3, style="varied", json_replies=True
        )
        for _ in range(10)
    ]
    check_tokenization(shipped_tokenizer, examples)  # raises on any difference
    for ex in examples:
        text = shipped_tokenizer.decode(answer_ids(shipped_tokenizer, ex))
        assert json.loads(text.removesuffix("<|im_end|>")) == {"answer": " " + ex.answer}


def test_shipped_model_answers_follow_up_turns_typed_as_in_a_chat(shipped_llm):
    """Held-out three-turn conversations in varied phrasing (most questions without the
    "Question: " prefix, as typed into ``chunkserve chat``): the third answer, after two
    answered turns, through the engine."""
    from modeltools.docqa_train import conversation_set
    from workers import SamplingParams

    examples = conversation_set(5, 24, 8, 3, "varied")
    convs = [ex.conversation()[:-1] for ex in examples]  # up to the last question
    outs = shipped_llm.chat(convs, SamplingParams(max_tokens=8, temperature=0))
    right = [
        docqa_data.answer_matches(o.text, ex.follow_ups[-1][1]) and o.finish_reason == "stop"
        for o, ex in zip(outs, examples, strict=True)
    ]
    assert sum(right) >= 0.95 * len(examples), [
        (ex.follow_ups[-1], o.text) for o, ex in zip(outs, examples, strict=True)
    ]


def test_shipped_model_answers_in_the_json_a_schema_asks_for(shipped_llm):
    from workers import SamplingParams
    from workers.engine.structured import ResponseFormat

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    examples = heldout_set(31, 16, 8)
    outs = shipped_llm.chat(
        [ex.messages for ex in examples],
        SamplingParams(max_tokens=24, temperature=0, response_format=fmt),
    )
    for o, ex in zip(outs, examples, strict=True):
        assert o.finish_reason == "stop", o.text
        reply = json.loads(o.text)
        assert set(reply) == {"answer"} and docqa_data.answer_matches(reply["answer"], ex.answer)


def test_the_plain_stream_draws_as_when_the_base_model_was_trained():
    """The plain style's examples and the tokenizer's training text, as the base model's
    run drew them (the digest is that stream's): the varied style and JSON replies must
    not change them, or make-model would build another tokenizer and the recipes in
    TRAINING.md would not replay."""
    import hashlib
    import random

    digest = hashlib.sha256()
    rng = random.Random(3)
    examples = [
        docqa_data.generate_example(rng, rng.randint(2, 16), "train", questions=8, reverse=True)
        for _ in range(20)
    ]
    examples += docqa_data.generate(5, 20, (2, 16)) + docqa_data.generate(6, 20, 8, "heldout")
    for ex in examples:
        digest.update(
            repr((ex.system, ex.documents, ex.question, ex.answer, ex.follow_ups)).encode()
        )
    digest.update(repr(docqa_data.tokenizer_texts(0, 20)).encode())
    assert digest.hexdigest() == "0427855d861cf2d30337865ed5fc0162587892a31b25f6ab784ef24a73e67b50"


def test_a_json_reply_is_judged_after_the_opening_the_grammar_forces():
    """``exact_match`` on JSON replies: the shipped model, which never chooses JSON by
    itself under a system prompt, is right on every reply token after the '{'."""
    from modeltools.docqa_train import conversation_set, exact_match, load_for_eval

    model, tokenizer = load_for_eval(SHIPPED, "cpu")
    examples = conversation_set(3, 8, 8, 1, json_replies=True)
    assert all(exact_match(model, tokenizer, examples, torch.device("cpu")))
    logits = model(input_ids=torch.tensor([prompt_ids(tokenizer, examples[0])])).logits
    assert tokenizer.decode(logits[0, -1].argmax()) != "{"  # the opening is not the model's


def test_training_leaves_the_json_opening_out_of_the_loss(shipped_tokenizer):
    """Training batches weigh the "{" that opens each JSON reply 0 (the grammar forces it,
    so the model never learns to choose the form); every other reply token, and plain
    replies' first tokens, keep the answer weight. ``json_opening`` true (exact_match's
    encoding) keeps the opening a target."""
    import random

    from modeltools.docqa_train import TrainConfig, _Batches, encode_batch

    rng = random.Random(8)
    examples = [
        docqa_data.generate_example(
            rng, rng.randint(2, 8), "train", questions=3, json_replies=i % 2 == 0
        )
        for i in range(8)
    ]
    opening = shipped_tokenizer.convert_tokens_to_ids("{")
    _, targets, kept, _ = encode_batch(shipped_tokenizer, examples, 5.0, 0.1)
    _, _, masked, _ = encode_batch(shipped_tokenizer, examples, 5.0, 0.1, json_opening=False)
    for row, ex in enumerate(examples):
        replies = 1 + len(ex.follow_ups)
        is_opening = (targets[row] == opening) & (kept[row] == 5.0)
        assert int(is_opening.sum()) == (replies if ex.json_replies else 0)
        assert (masked[row][is_opening] == 0).all()
        assert torch.equal(masked[row][~is_opening], kept[row][~is_opening])
        answered = int((kept[row] == 5.0).sum())
        assert int((masked[row] == 5.0).sum()) == answered - int(is_opening.sum())
    assert TrainConfig().json_opening_loss is False
    cfg = TrainConfig(batch_size=16, json_share=0.5, guide_weight=0.0)
    _, targets, weights, _ = next(iter(_Batches(shipped_tokenizer, cfg)))
    assert (targets == opening).any() and not (weights[targets == opening] > 0.1).any()
    trained = TrainConfig(batch_size=16, json_share=0.5, guide_weight=0.0, json_opening_loss=True)
    _, targets, weights, _ = next(iter(_Batches(shipped_tokenizer, trained)))
    assert (weights[targets == opening] == trained.answer_weight).any()


def test_every_composed_question_part_avoids_the_heldout_templates():
    """Each frame with each subject phrase of its kind (every pair, not a sample): no
    word only held-out templates have; the one pairs that spell a held-out template are
    exactly it (``composed_question`` draws again there). The imperative and possessive
    frames are among the parts."""
    from modeltools import docqa_phrasing
    from modeltools.docqa_phrasing import HELDOUT_QUESTION_WORDS, _words, heldout_questions

    _, questions = _heldout_patterns()
    spelled, asked = set(), set()
    for frames, refs in docqa_phrasing.COMPOSED_QUESTIONS.values():
        for frame in frames:
            for ref, possessive in refs:
                if possessive is None and "{xp}" in frame:
                    continue
                text = frame.format(x=ref, xp=possessive or "").format(s="Mira")
                asked.add(text)
                assert not _words(text) & HELDOUT_QUESTION_WORDS, text
                if any(q.fullmatch(text.rstrip("?.")) for q in questions):
                    assert text.lower().rstrip("?.") in heldout_questions("Mira"), text
                    spelled.add(text)
    assert len(spelled) <= 2, spelled
    for expected in (
        "Give the team of Mira.",
        "State Mira's age.",
        "Who is the Mira team's head?",
        "Where is the team Mira plays for based?",
    ):
        assert expected in asked
    samples = _composed_conversations(600)
    drawn = {_bare(q) for ex in samples for q in [ex.question, *(q for q, _ in ex.follow_ups)]}
    assert any(q.startswith(("Give ", "State ", "Say ")) for q in drawn)
    import re

    assert any(
        re.fullmatch(r"Who is the \w+ team's (head|boss|chief|manager)\??", q) for q in drawn
    )


def test_blend_writes_the_weighted_mean_of_two_checkpoints(tmp_path):
    """``docqa_train blend``: weight x TUNED + (1 - weight) x BASE, tensor by tensor, the
    tuned checkpoint's other files, and training.json with the blend's evaluation."""
    from safetensors.torch import load_file, save_file

    from modeltools.docqa_train import main

    tuned = tmp_path / "tuned"
    tuned.mkdir()
    for f in SHIPPED.iterdir():
        if f.is_file() and f.suffix != ".md":
            (tuned / f.name).write_bytes(f.read_bytes())
    base = load_file(SHIPPED / "model.safetensors")
    shifted = {k: (v.float() + 0.5).to(v.dtype) for k, v in base.items()}
    save_file(shifted, tuned / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "blend"
    args = ["blend", str(out), str(tuned), str(SHIPPED), "--weight", "0.75"]
    assert main([*args, "--final-eval-examples", "2", "--device", "cpu"]) == 0
    blended = load_file(out / "model.safetensors")
    for k, v in base.items():
        expected = (0.75 * shifted[k].float() + 0.25 * v.float()).to(v.dtype)
        assert blended[k].dtype == v.dtype and torch.equal(blended[k], expected), k
    assert (out / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    summary = json.loads((out / "training.json").read_text())
    assert summary["blend"]["weight"] == 0.75 and summary["config"]["answer_space"]
    assert summary["heldout"]["8docs"]["examples"] == 2 and "8docs, json" in summary["heldout"]
    assert summary["base"] == json.loads((SHIPPED / "training.json").read_text())
    with pytest.raises(ValueError, match="weight"):
        main(["blend", str(tmp_path / "bad"), str(tuned), str(SHIPPED), "--weight", "1.5"])
