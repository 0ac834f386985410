"""The example's views: JSON, a CSRF-protected form, a file upload."""

import hashlib
import os

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET, require_http_methods, require_POST


@require_GET
def hello(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"message": "Hello from Django", "pid": os.getpid()})


@require_http_methods(["GET", "POST"])
def form(request: HttpRequest) -> HttpResponse:
    """GET: the form, with its CSRF token (and the csrftoken cookie); POST: the greeting.
    A POST without a valid token never gets here: CsrfViewMiddleware answers 403."""
    if request.method == "POST":
        name = request.POST.get("name", "")
        if not name:
            return HttpResponseBadRequest("name is required\n")
        return render(request, "greeting.html", {"name": name})
    return render(request, "form.html")


@require_POST
def upload(request: HttpRequest) -> JsonResponse:
    """A multipart upload (CSRF-protected like any POST): its size and SHA-256, read in
    chunks (Django spools a file over FILE_UPLOAD_MAX_MEMORY_SIZE to a temporary file)."""
    uploaded = request.FILES.get("file")
    if uploaded is None:
        return JsonResponse({"error": "no file"}, status=400)
    digest = hashlib.sha256()
    for chunk in uploaded.chunks():
        digest.update(chunk)
    return JsonResponse({"filename": uploaded.name, "size": uploaded.size,
                         "sha256": digest.hexdigest()})
