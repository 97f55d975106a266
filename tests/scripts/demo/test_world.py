"""The demo world and its demonstrations: deterministic, consistent, and leaving RL a gap."""

from __future__ import annotations

from collections import Counter

from scripts.demo.demonstrations import WorldSearch, make_demonstrations
from scripts.demo.world import ONE_HOP_KINDS, TWO_HOP_KINDS, all_questions, make_world, split_by_subject


def test_the_same_seed_builds_the_same_world_and_another_seed_a_different_one() -> None:
    assert make_world(3).passages() == make_world(3).passages()
    assert make_world(3).people != make_world(4).people


def test_passages_state_every_answer_in_the_documented_form() -> None:
    world = make_world(0, n_people=20, n_cities=8, n_companies=8, n_countries=3, n_founders=8)
    passages = [p["contents"] for p in world.passages()]
    person = world.people[0]
    assert f'"{person}"\n{person} was born in {world.birthplace[person]} and works at {world.employer[person]}.' in passages
    city = world.cities[0]
    assert f'"{city}"\n{city} is a city in {world.country_of[city]}.' in passages
    names = world.people + world.cities + world.companies + world.countries + world.founders
    assert len(names) == len(set(names))


def test_two_hop_answers_follow_the_chain_of_one_hop_facts() -> None:
    world = make_world(1)
    for q in all_questions(world, TWO_HOP_KINDS)[:50]:
        first = world.birthplace[q.subject] if q.kind == "birth_country" else world.employer[q.subject]
        assert q.hops == (q.subject, first)
        assert q.answer == (world.country_of[first] if q.kind == "birth_country" else world.founder_of[first])


def test_held_out_subjects_never_appear_in_training_questions() -> None:
    questions = all_questions(make_world(0), ONE_HOP_KINDS)
    train, test = split_by_subject(questions, 0.3, seed=0)
    assert train and test
    assert {q.subject for q in train}.isdisjoint({q.subject for q in test})


def test_searching_the_subject_retrieves_its_passage_first() -> None:
    world = make_world(0)
    search = WorldSearch(world.passages())
    questions = all_questions(world, ONE_HOP_KINDS + TWO_HOP_KINDS)[::7]
    queries = [hop for q in questions for hop in q.hops]
    hits = search.search(queries, topk=2)
    assert all(h[0].title == query for query, h in zip(queries, hits, strict=True))


def test_demonstrations_search_for_real_or_guess_a_wrong_entity_of_the_right_type() -> None:
    worlds = [make_world(101), make_world(102)]
    demos = make_demonstrations(worlds, 600, topk=2, seed=0)
    guessed = Counter()
    total = Counter()
    for question, turns in demos:
        total[question.kind] += 1
        final = turns[-1].text
        if len(turns) == 1:
            guessed[question.kind] += 1
            guess = final.split("<answer>")[1].split("</answer>")[0].strip()
            assert guess != question.answer
            assert any(guess in w.entities_of_type(question.answer_type) for w in worlds)
        else:
            observations = [t.text for t in turns if t.role == "observation"]
            assert len(observations) == len(question.hops)
            assert question.answer in observations[-1]
            assert all(o.startswith("\n\n<information>Doc 1(Title: ") for o in observations)
            assert f"<answer> {question.answer} </answer>" in final
    # The gap RL must close: some kinds are mostly searched, others mostly guessed.
    assert guessed["birthplace"] / total["birthplace"] < 0.35
    assert guessed["founder"] / total["founder"] > 0.5
