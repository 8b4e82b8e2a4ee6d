"""Who holds which job: found where a file names a person beside their role, asked both
ways on the card, and practised both ways in other words."""

from __future__ import annotations

import pytest

from worker.dataset.build import build_dataset, make_generated_qa
from worker.dataset.colleague import REVERSE, make_probes, role_questions, well_formed
from worker.dataset.corpus import SourceDoc
from worker.dataset.probes import normalise
from worker.dataset.roles import document_roles, roles_in


def _pairs(sentence: str) -> list[tuple[str, str]]:
    return [(r.name, r.role) for r in roles_in(sentence, "minutes.txt")]


@pytest.mark.parametrize(
    ("sentence", "expected"),
    [
        ("The rota is drawn up by the Service Manager, Agnieszka Marlow, and published monthly.",
         [("Agnieszka Marlow", "Service Manager")]),
        ("Holiday in August needs written approval from the Operations Manager, Hollis Fenwright.",
         [("Hollis Fenwright", "Operations Manager")]),
        ("Ask your line manager or our HR Advisor, Keziah Morrow, before you act on it.",
         [("Keziah Morrow", "HR Advisor")]),
        ("Owner: Femi Adebanjo-Reid, Quality Lead.", [("Femi Adebanjo-Reid", "Quality Lead")]),
        ("Parts are ordered from Dougal Frain, the warehouse supervisor at Kestle Down.",
         [("Dougal Frain", "warehouse supervisor")]),
        ("Ravi Okonjo-Hart, the workshop lead, will give you your keys.",
         [("Ravi Okonjo-Hart", "workshop lead")]),
        ("Contact Hollis Fenwright, Operations Manager, about overtime.",
         [("Hollis Fenwright", "Operations Manager")]),
        ("Sick notes go to Dr Ana Silva, our Medical Officer.",
         [("Ana Silva", "Medical Officer")]),
        (("Present: Delphine Ashgrove, Managing Director (chair); Oren Blackstock, Finance "
          "Manager; Dana Ruiz, Head of Logistics."),
         [("Delphine Ashgrove", "Managing Director"), ("Oren Blackstock", "Finance Manager"),
          ("Dana Ruiz", "Head of Logistics")]),
        # A contact list's lines, as fact_sentences reads them under their heading.
        ("Contacts — HR Manager: Priya Nandakumar (ext. 214).",
         [("Priya Nandakumar", "HR Manager")]),
        ("Our Office Manager: Tomasz Welling.", [("Tomasz Welling", "Office Manager")]),
        ("Key people — Priya Nandakumar – Finance Director, ext. 5.",
         [("Priya Nandakumar", "Finance Director")]),
        ("Send it to Tomasz Welling (Facilities Coordinator) by Friday.",
         [("Tomasz Welling", "Facilities Coordinator")]),
    ],
)
def test_a_person_named_beside_their_job(sentence, expected):
    assert _pairs(sentence) == expected


@pytest.mark.parametrize(
    "sentence",
    [
        # Not a job title: a description, a company, a product, a place.
        "The company was founded in 1994 by Delphine Ashgrove, a former hotel chef.",
        "Saltgrove Catering Equipment, based in Wrenmoor, supplies restaurants.",
        "The Quiet Hinge, our best seller, costs $18.75.",
        "Deliveries go to Kestle Down, the warehouse, by 10:30.",
        # A title is not a person, nor a person's name cut short by a title.
        "The Sales Director, the Finance Manager and the Quality Lead met on Monday.",
        "Ask the Operations Manager, who signs off overtime.",
        # Half of a longer phrase: "Service Manager" is not followed by its end.
        "Ring Dana Ruiz, Service Manager cover rota holder, on Mondays.",
        # Who chairs a meeting is not a job; a label that is no job title names none.
        "Present: Ottilie Brannock (chair), Hollis Fenwright, Imogen Tresco.",
        "Minutes — Note: Priya Nandakumar will call back.",
        "Practice meeting — Chair: Rhiannon Tewksbury.",
        "Actions — Owner: Piotr Lindqvist.",
    ],
)
def test_no_person_and_job_where_there_is_none(sentence):
    assert _pairs(sentence) == []


def test_a_job_named_for_two_people_or_a_person_for_two_jobs_is_left_out():
    text = ("Our Sales Director, Rosalind Achterberg, chairs the meeting. "
            "Questions to Oren Blackstock, Sales Director. "
            "Minutes by Keziah Morrow, HR Advisor. Keziah Morrow, Office Manager, signs them. "
            "Approved by the Quality Lead, Femi Adebanjo-Reid. "
            "Femi Adebanjo-Reid, Quality Lead, keeps the records.")
    found = [(r.name, r.role) for _, r in document_roles("minutes.txt", text)]
    assert found == [("Femi Adebanjo-Reid", "Quality Lead")]  # once, though named twice


TEXT = ("Staff handbook. The rota is drawn up by the Service Manager, Agnieszka Marlow, and "
        "published on the first working day of each month. Parts are ordered from Dougal Frain, "
        "the warehouse supervisor at Kestle Down. The NW-4471 Torque Sprocket costs $129.50.")


def test_the_card_asks_both_ways_and_the_practice_teaches_both_ways_in_other_words():
    docs = [("staff_handbook.pdf", TEXT)]
    (_, marlow), (_, frain) = document_roles(*docs[0])
    asked = role_questions(marlow) + role_questions(frain)
    assert [(a.question, a.answer) for a in asked] == [
        ("Who is our Service Manager?", "Agnieszka Marlow"),
        ("What is Agnieszka Marlow's job?", "Service Manager"),
        ("Who is our warehouse supervisor?", "Dougal Frain"),
        ("What is Dougal Frain's job?", "warehouse supervisor"),
    ]
    assert all(a.kind == REVERSE and well_formed(a.question, a.answer) for a in asked)

    probes = make_probes(docs, max_probes=40)
    on_card = [p for p in probes if p.template.startswith("role_")]
    assert len(on_card) == 2  # one question a sentence
    practice = make_generated_qa(docs, probes, per_fact=2)  # the default's phrasings
    taught = {(normalise(q), normalise(a)) for q, a in practice}
    for name, role in (("Agnieszka Marlow", "Service Manager"),
                       ("Dougal Frain", "warehouse supervisor")):
        # Asked by the job, answered with the person; asked by the person, with the job.
        by_job = [a for q, a in taught if normalise(role) in q and normalise(name) not in q]
        by_name = [a for q, a in taught if normalise(name) in q and normalise(role) not in q]
        assert by_job and all(normalise(name) in a for a in by_job)
        assert by_name and all(normalise(role) in a for a in by_name)
    # Never the card's own question (DESIGN.md's honesty rule).
    card = {normalise(p.question) for p in probes}
    assert not card & {q for q, _ in taught}
    assert not any(q.startswith(("who is our", "what is")) and "job" in q for q, _ in taught)


def test_every_person_and_job_saltgrove_s_files_name_is_found(tmp_path):
    """The third calibration company's eight files (tests/fixtures/fullsize_docs.py) name
    nine people beside their jobs, in five ways: role first, name first, a lower-case role
    with a place after it, a list of those present, a signature line; a support case's
    answer names a tenth."""
    from scripts.experiments.recall import load_corpus

    docs = load_corpus(tmp_path, "fullsize")
    found = {(r.name, r.role) for d in docs for _, r in document_roles(d.name, d.text)}
    in_answers = {(r.name, r.role) for d in docs for a in d.qa_pairs
                  for _, r in document_roles(d.name, a[1])}
    assert in_answers == {("Sunniva Holt", "Customer Service Lead")}  # the support cases'
    assert found == {
        ("Keziah Morrow", "HR Advisor"), ("Agnieszka Marlow", "Service Manager"),
        ("Femi Adebanjo-Reid", "Quality Lead"), ("Tobias Qureshi-Lane", "Operations Director"),
        ("Linus Pemberton-Yau", "IT Manager"), ("Dougal Frain", "warehouse supervisor"),
        ("Delphine Ashgrove", "Managing Director"), ("Rosalind Achterberg", "Sales Director"),
        ("Oren Blackstock", "Finance Manager"),
    }


def test_jobs_take_at_most_a_tenth_of_the_card():
    people = [("Ana", "Silva"), ("Ben", "Okafor"), ("Cara", "Lindqvist"), ("Dev", "Pattani"),
              ("Eve", "Marchetti"), ("Finn", "Oduya"), ("Gus", "Trelawney"), ("Hana", "Kovacs")]
    jobs = ["Sales Director", "Finance Manager", "Quality Lead", "IT Manager", "HR Advisor",
            "Service Manager", "Operations Director", "Customer Care Lead"]
    text = " ".join(f"Questions about item {k} go to {first} {last}, {job}."
                    for k, ((first, last), job) in enumerate(zip(people, jobs, strict=True)))
    assert len(document_roles("team.txt", text)) == 8
    probes = make_probes([("team.txt", text)], max_probes=20)
    assert sum(p.template.startswith("role_") for p in probes) == 20 // 10


COMPLAINT = ("We've had a problem with an engineer's visit. Who do I complain to?",
             ("Please contact our Customer Service Lead, Sunniva Holt, at "
              "care@saltgrove.example. She replies to every complaint within three working "
              "days."))
SUPPORT_PAIRS = [
    COMPLAINT,
    ("Do you charge for delivery?", "Delivery is free on orders over £750; smaller orders cost £55."),
    ("How long is the warranty?", "All Glacia refrigeration carries a 3-year warranty."),
    ("Can we hire a fridge?", "Yes. Glacia upright fridges can be hired from £52 a week."),
]


def test_a_job_named_in_a_question_answer_pair_is_practised_unless_the_pair_is_held_out(
        smol_tokenizer):
    """A support file's answer that names who holds a job teaches it both ways, as a
    document's sentence does; a pair held out to score answers teaches nothing of it."""
    docs = [SourceDoc("support_cases.csv", "c" * 64, "", SUPPORT_PAIRS),
            SourceDoc("handbook.txt", "h" * 64,
                      "Annual leave is 25 days a year. The office opens at 8:30 on weekdays.")]
    seen = set()
    for seed in range(8):
        split = build_dataset(docs, smol_tokenizer, max_seq_len=256, holdout_frac=0.25,
                              seed=seed, generated_qa=2)
        texts = [smol_tokenizer.decode(e["input_ids"]) for e in split.train_examples]
        by_job = any("Which member of staff is the Customer Service Lead?" in t and
                     "The Customer Service Lead is Sunniva Holt." in t for t in texts)
        by_name = any("What post does Sunniva Holt hold?" in t and
                      "Sunniva Holt is the Customer Service Lead." in t for t in texts)
        held = COMPLAINT in split.heldout_qa
        assert by_job == by_name == (not held), seed
        seen.add(held)
    assert seen == {True, False}  # both cases met


def test_the_card_asks_a_job_named_in_an_answer_and_never_as_practised():
    docs = [("handbook.txt", "Annual leave is 25 days a year.")]
    answers = [("support_cases.csv", COMPLAINT[1])]
    probes = make_probes(docs, max_probes=40, answers=answers)
    jobs = [(p.question, p.answer, p.source) for p in probes if p.template.startswith("role_")]
    assert jobs == [("Who is our Customer Service Lead?", "Sunniva Holt", "support_cases.csv")]
    assert make_probes(docs, max_probes=40) == [  # nothing else from an answer
        p for p in probes if not p.template.startswith("role_")]
    practice = make_generated_qa(docs, probes, per_fact=2, answers=answers)
    taught = {normalise(q) for q, _ in practice}
    assert normalise("Which member of staff is the Customer Service Lead?") in taught
    assert not taught & {normalise(p.question) for p in probes}
    assert not any("within three working days" in a for _, a in practice)  # jobs, nothing else
