"""The model's worker replaced by the test, for HTTP tests that script an
answer token by token: install(controller) makes its new_job give a Job that
the test fills with Tokens and a Done, and returns the list of jobs made."""

from __future__ import annotations

import pytest

from daemon import protocol as p
from daemon.model.jobs import Job


@pytest.fixture
def scripted(monkeypatch):
    def install(controller) -> list[Job]:
        jobs: list[Job] = []

        def new_job(endpoint, params, tools=(), keep_alive=None, max_wait=None, **fields):
            # as the controller's: `fields` are p.Submit's (prompt or messages, n, the template's arguments)
            job = Job(p.Submit(f"job{len(jobs)}", params, tools=list(tools), **fields), endpoint)
            jobs.append(job)
            return job

        monkeypatch.setattr(controller, "new_job", new_job)
        return jobs

    return install
