"""Settings of the example project, as a production deployment would have them: DEBUG off,
the secret key from the environment, static files collected and served by WhiteNoise.

Environment:
- ``DJANGO_SECRET_KEY``: the secret key. Without it a development key is used, which is
  published here and so must never sign a real site's cookies.
- ``DJANGO_ALLOWED_HOSTS``: comma-separated host names (default ``127.0.0.1,localhost``).
- ``DJANGO_STATIC_ROOT``: where ``collectstatic`` writes and WhiteNoise serves from (default
  ``staticfiles/`` beside manage.py).

No database: the example has no models, sessions or users (the CSRF token lives in its cookie).
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-dev-only-never-use-in-production")
DEBUG = False
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")

INSTALLED_APPS = [
    "django.contrib.staticfiles",  # collectstatic and the manifest behind {% static %}
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Right after SecurityMiddleware, as WhiteNoise documents: static files are answered
    # before the rest of the stack runs.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "mysite.urls"
WSGI_APPLICATION = "mysite.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": False,
        "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
    },
]

DATABASES: dict = {}

USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
# collectstatic runs once at build or deploy time, before the server starts; WhiteNoise then
# serves this directory, which it scans once when each worker loads the app.
STATIC_ROOT = Path(os.environ.get("DJANGO_STATIC_ROOT", BASE_DIR / "staticfiles"))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Content-hashed names (style.3f2a....css) that WhiteNoise serves with a far-future,
    # immutable Cache-Control, and gzip (and brotli, where installed) copies made once.
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

# With DEBUG off Django sends errors to the admins' mail only (there are none): log them to
# stderr, which forkserve's workers share with the server's error log.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"django": {"handlers": ["stderr"], "level": "WARNING"}},
}
