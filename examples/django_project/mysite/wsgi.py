"""The WSGI entry point forkserve loads: ``forkserve --chdir examples/django_project
mysite.wsgi:application`` (``--chdir`` puts examples/django_project on ``sys.path``, where
the ``mysite`` package is)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")

application = get_wsgi_application()
