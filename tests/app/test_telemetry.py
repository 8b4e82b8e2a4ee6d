"""The "Memory and disk" panel of a job page, from the offload engine's figures."""

from __future__ import annotations

from app.db import session_scope
from app.models import JobState
from app.services.telemetry import describe

from .factories import htmx, make_job, make_project

GB = 2**30

# What worker.training.engines.OffloadTrainEngine.telemetry() reports (a subset is enough).
STREAMING = {
    "mode": "full",
    "streaming": True,
    "o_direct": True,
    "blocks": 12,
    "budget_bytes": 2 * GB,
    "peak_bytes": 410 * 2**20,
    "peak_rss_bytes": 700 * 2**20,
    "bytes_read": int(3.1 * GB),
    "bytes_written": int(1.2 * GB),
    "read_gbps": 1.44,
    "write_gbps": 1.1,
    "step_s": 100.0,
    "stall_s": 4.0,
    "prefetch_hit_rate": 0.97,
    "blocks_read_from_weights_files": 0,
}
FITS = STREAMING | {
    "streaming": False,
    "mode": "frozen_base",
    "bytes_read": 300_000,
    "bytes_written": 0,
    "stall_s": 0.0,
    "blocks_read_from_weights_files": 30,
    "blocks": 30,
}


def test_streaming_in_plain_words():
    panel = describe(STREAMING)
    assert panel.streaming
    assert panel.sentence == (
        "Streams 12 blocks from the SSD: 3.1 GB read, 1.2 GB written, 1.4 GB/s; "
        "waited on the disk 4% of the time; peak memory 410.0 MB of a 2.0 GB budget."
    )
    assert ("Blocks ready before they were needed", "97%") in panel.details


def test_fitting_in_memory_and_lora_reading_its_base_file():
    panel = describe(FITS)
    assert not panel.streaming
    assert panel.sentence == (
        "Fits in memory: all 30 blocks stay in memory, nothing streams from the SSD; "
        "peak memory 410.0 MB of a 2.0 GB budget."
    )
    assert ("Blocks read straight from the base model's file", "30") in panel.details
    lora_streaming = describe(FITS | {"streaming": True, "bytes_read": GB, "stall_s": 0.2})
    assert "1.0 GB read, nothing written" in lora_streaming.sentence
    assert "waited on the disk under 1% of the time" in lora_streaming.sentence


def test_no_panel_without_figures_and_odd_values_do_not_break_it():
    assert describe(None) is None and describe({}) is None
    panel = describe({"streaming": True, "step_s": 0, "peak_bytes": None, "read_gbps": "x"})
    assert panel.sentence == "Streams the model from the SSD: 0 bytes read, nothing written."


def test_job_page_and_api_show_the_figures(client):
    with session_scope() as session:
        job_id = make_job(session, make_project(session), JobState.running, telemetry=STREAMING).id
        quiet_id = make_job(session, make_project(session, "Other"), JobState.running).id
    fragment = client.get(f"/jobs/{job_id}", headers=htmx("job-live")).text
    assert "Memory and disk" in fragment
    assert "Streams 12 blocks from the SSD: 3.1 GB read" in fragment
    assert "Memory and disk" not in client.get(f"/jobs/{quiet_id}").text

    data = client.get(f"/api/jobs/{job_id}").json()
    assert data["telemetry"] == STREAMING
    assert client.get(f"/api/jobs/{quiet_id}").json()["telemetry"] is None
