from django.urls import path

from mysite import views

urlpatterns = [
    path("api/hello", views.hello),
    path("form", views.form),
    path("upload", views.upload),
]
