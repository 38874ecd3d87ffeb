"""scheduler_svc.media: the image checks before decoding, and fetching from --allowed-media-domains
(a local HTTP server: allowed host, size cap, redirects to another host refused)."""

from __future__ import annotations

import http.server
import io
import threading

import pytest
from PIL import Image

from pagoda.v1 import generation_pb2 as pb
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.media import (
    MAX_IMAGE_BYTES, MediaConfig, check_parts, decode_image, fetch_image, image_bytes, parse_limit_mm,
)


def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


PNG = encoded(Image.new("RGB", (6, 4), (10, 200, 30)), "PNG")


@pytest.fixture(scope="module")
def server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/image.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.wfile.write(PNG)
            elif self.path == "/huge":
                self.send_response(200)
                self.send_header("Content-Length", str(MAX_IMAGE_BYTES + 1))
                self.end_headers()
            elif self.path == "/elsewhere":  # to the same server by another name: not an allowed domain
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/image.png")
                self.end_headers()
            elif self.path == "/here":
                self.send_response(302)
                self.send_header("Location", "/image.png")
                self.end_headers()
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def test_images_of_allowed_domains_are_fetched_within_the_limits(server):
    assert fetch_image(f"{server}/image.png", "f", ("127.0.0.1",)) == PNG
    assert fetch_image(f"{server}/here", "f", ("127.0.0.1",)) == PNG  # a redirect within the allowed host
    assert image_bytes(pb.Image(url=f"{server}/image.png"), "img", ("127.0.0.1",)) == PNG
    for path, words in [("/huge", "more than"), ("/elsewhere", "none allowed for http://localhost"),
                        ("/missing", "could not be fetched")]:
        with pytest.raises(InvalidArgument, match=words) as err:
            fetch_image(f"{server}{path}", "f.url", ("127.0.0.1",))
        assert err.value.field == "f.url"
    with pytest.raises(InvalidArgument, match="none allowed"):
        fetch_image(f"{server}/image.png", "f", ("example.com",))


def test_urls_are_refused_before_any_work_unless_allowed():
    chat = pb.Chat()
    message = chat.messages.add(role="user")
    message.parts.add(image=pb.Image(url="file:///etc/passwd"))
    for domains in [(), ("etc",), ("",)]:
        with pytest.raises(InvalidArgument) as err:
            check_parts(chat, "prompt.chat", MediaConfig(allowed_domains=domains))
        assert err.value.field == "prompt.chat.messages[0].parts[0].image.url"
    message.parts[0].image.url = "https://img.example.com/cat.png"
    check_parts(chat, "prompt.chat", MediaConfig(allowed_domains=("example.com",)))  # a subdomain of an allowed one
    with pytest.raises(InvalidArgument):
        check_parts(chat, "prompt.chat", MediaConfig(allowed_domains=("ample.com",)))


def test_formats_and_the_first_frame_of_a_gif():
    frames = [Image.new("RGB", (5, 3), color) for color in ((255, 0, 0), (0, 0, 255))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(gif, "x").getpixel((0, 0)) == (255, 0, 0)
    for fmt in ("PNG", "JPEG", "WEBP"):
        assert decode_image(encoded(frames[1], fmt), "x").size == (5, 3)
    with pytest.raises(InvalidArgument, match="supported format"):
        decode_image(encoded(frames[1], "TIFF"), "x")
    noisy = encoded(Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48), "PNG")
    with pytest.raises(InvalidArgument, match="cannot be decoded"):  # the header is whole, the pixels cut
        decode_image(noisy[: len(noisy) // 2], "x")


def test_limit_mm_per_prompt():
    assert parse_limit_mm(["image=3"]) == 3
    assert parse_limit_mm(['{"image": 0}']) == 0
    for bad in (["video=2"], ["image=-1"], ["image"]):
        with pytest.raises(ValueError):
            parse_limit_mm(bad)
