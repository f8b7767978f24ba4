"""A local OBS-compatible endpoint for the storage tests: moto's server, in-process, on 127.0.0.1:0.

The real esdk-obs-python talks to it (path-style, region us-east-1, v4 or v2;
docs/architecture.md, "Tests"). Objects are seeded with boto3, an independent client,
so a bug in our OBS adapter cannot hide itself in the fixtures.
"""

import os
import socket
import threading
import uuid

import pytest

ACCESS_KEY = "testak"
SECRET_KEY = "testsk-secret-value"


class Endpoint:
    def __init__(self, url: str):
        self.url = url
        import boto3

        self.s3 = boto3.client(
            "s3", endpoint_url=url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.s3.create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=bucket, Key=key, Body=data)

    def env(self, signature: str = "v4") -> dict:
        """The job environment that points ma-runtime at this endpoint."""
        return {
            "MA_S3_ENDPOINT": self.url,
            "OBS_ACCESS_KEY_ID": ACCESS_KEY,
            "OBS_SECRET_ACCESS_KEY": SECRET_KEY,
            "MA_RUNTIME_STORAGE_SIGNATURE": signature,
            "MA_RUNTIME_STORAGE_REGION": "us-east-1",
        }


@pytest.fixture(scope="session")
def obs_endpoint():
    moto_server = pytest.importorskip("moto.server")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield Endpoint(f"http://{host}:{port}")
    server.stop()


@pytest.fixture
def hanging_endpoint():
    """An endpoint that accepts connections and never answers (a hung server or proxy)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept():
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for connection in held:
        connection.close()


def refusing_endpoint() -> str:
    """An endpoint nothing listens on: every connection is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"  # closed on return: nothing listens there
