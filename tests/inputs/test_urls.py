"""A URL's identity and what is shown of it: no password, no signature (qwenvl_vision.inputs.urls)."""

from __future__ import annotations

import pytest

from qwenvl_vision.inputs.urls import canonical, redacted, redacted_text


@pytest.mark.parametrize("url, identity, shown", [
    ("https://alice:pw@h.example/a.jpg?X-Amz-Credential=AK&X-Amz-Signature=s&width=3",
     "https://h.example/a.jpg?width=3", "https://alice:***@h.example/a.jpg?X-Amz-Credential=***&X-Amz-Signature=***&width=3"),
    ("https://acct.blob.core.windows.net/c/a.jpg?sv=2022&se=2026&sr=b&sp=r&sig=abc",  # an Azure SAS
     "https://acct.blob.core.windows.net/c/a.jpg", "https://acct.blob.core.windows.net/c/a.jpg?sv=***&se=***&sr=***&sp=***&sig=***"),
    ("https://d.cloudfront.net/a.jpg?Expires=1&Signature=s&Key-Pair-Id=k&v=2",
     "https://d.cloudfront.net/a.jpg?v=2", "https://d.cloudfront.net/a.jpg?Expires=***&Signature=***&Key-Pair-Id=***&v=2"),
    ("https://storage.googleapis.com/b/a.jpg?X-Goog-Signature=s", "https://storage.googleapis.com/b/a.jpg",
     "https://storage.googleapis.com/b/a.jpg?X-Goog-Signature=***"),
    ("http://TOKEN@h/a.jpg", "http://h/a.jpg", "http://***@h/a.jpg"),  # a user alone authenticates: a token
    # Elsewhere the user may choose the object (an ADLS container): only a password goes.
    ("abfs://container@acct.dfs.core.windows.net/a.jpg", "abfs://container@acct.dfs.core.windows.net/a.jpg",
     "abfs://container@acct.dfs.core.windows.net/a.jpg"),
    ("ftp://alice:pw@host/a.jpg", "ftp://alice@host/a.jpg", "ftp://alice:***@host/a.jpg"),
    # A signature's companions alone are ordinary parameters; a credential parameter is not.
    ("https://picsum.photos/200?sig=1", "https://picsum.photos/200?sig=1", "https://picsum.photos/200?sig=1"),
    ("https://h/img.jpg?sp=1&w=100", "https://h/img.jpg?sp=1&w=100", "https://h/img.jpg?sp=1&w=100"),
    ("https://h/a.jpg?token=t&w=1", "https://h/a.jpg?w=1", "https://h/a.jpg?token=***&w=1"),
    ("https://h.example.com?X-Amz-Signature=s", "https://h.example.com", "https://h.example.com?X-Amz-Signature=***"),
    ("s3://bucket/a?sig=1#b.jpg", "s3://bucket/a?sig=1#b.jpg", "s3://bucket/a?sig=1#b.jpg"),  # a key's characters
    ("https://h/plain.jpg?w=1#part", "https://h/plain.jpg?w=1#part", "https://h/plain.jpg?w=1#part"),
])
def test_identity_and_shown_form(url, identity, shown):
    assert canonical(url) == identity and redacted(url) == shown
    assert canonical(identity) == identity  # an identity is its own


def test_urls_inside_a_message_are_redacted():
    message = "cannot read https://bob:secret@h/x.jpg?Signature=zz (403, url='https://h/x.jpg?X-Amz-Signature=q')"
    assert redacted_text(message) == ("cannot read https://bob:***@h/x.jpg?Signature=*** "
                                      "(403, url='https://h/x.jpg?X-Amz-Signature=***')")
    assert redacted_text(None) is None and redacted_text("/local/a.jpg: not found") == "/local/a.jpg: not found"
    # A sentence's punctuation after a URL stays the sentence's.
    assert redacted_text("https://h/p?Signature=abc: cannot decode") == "https://h/p?Signature=***: cannot decode"
    assert redacted_text("failed (https://h/p?Signature=abc).") == "failed (https://h/p?Signature=***)."
