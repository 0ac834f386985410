"""The framework examples (examples/flask_app, examples/django_project) behind a gate, for
the drain test of tests/integration/test_frameworks.py.

A request with ``X-Test-Gate: PATH`` waits on that FIFO (``tests.apps.basic.wait_gate``)
before the framework sees it, so the test holds real framework requests in flight across a
TERM without any change to the examples; every other request goes straight through. Served
with the example's ``--chdir``, which puts its directory on ``sys.path``:

    forkserve --chdir examples/flask_app 'tests.apps.frameworks:flask()'
    forkserve --chdir examples/django_project 'tests.apps.frameworks:django()'
"""

from __future__ import annotations

from tests.apps.basic import wait_gate


def gated(inner):
    def app(environ, start_response):
        fifo = environ.get("HTTP_X_TEST_GATE")
        if fifo:
            wait_gate(fifo)
        return inner(environ, start_response)
    return app


def flask():
    from app import app  # examples/flask_app/app.py, found through --chdir

    return gated(app)


def django():
    from mysite.wsgi import application  # examples/django_project/mysite, through --chdir

    return gated(application)
