import requests


def test_serves_hello(server):
    response = requests.get(server.url + "/", timeout=10)
    assert response.status_code == 200
    assert response.text == "hello\n"
    assert response.headers["Server"] == "forkserve"
    assert "Date" in response.headers
