"""WSGI apps the integration tests run through real forkserve processes, one module each
(``tests.apps.basic:app``, ``tests.apps.drain:app``...). Empty on purpose: it runs before
every one of them, and an app's import-time behaviour (``basic`` fails on
``TESTAPP_FAIL_IMPORT``, ``lifecycle`` exits on ``LIFECYCLE_EXIT_ON_IMPORT``) must stay its own."""
