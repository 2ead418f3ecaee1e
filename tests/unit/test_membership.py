"""Pure domain rules: membership by tags, the stored form of collections, KB settings
validation, per-org default KB ids, key resolution and the size-limit message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from services.common.bus.registry import ApiKey
from services.common.domain.content import check_size
from services.common.domain.errors import InvalidInput, TooLarge
from services.common.domain.models import KnowledgeBase, join_tags, kb_tag, split_tags
from services.common.settings import Settings
from services.gateway.auth import KeyResolver, Unauthorized, hash_key
from services.gateway.catalog import Catalog
from services.gateway.schemas import KbCreate
from services.gateway.service import KnowledgeBases, checked_kb


def kb(**fields) -> KnowledgeBase:
    return KnowledgeBase(org_id="o", kb_id="k1", name="n", **fields)


def test_membership_is_tag_intersection_or_the_implicit_kb_tag():
    """A document belongs to a KB when its tags meet the KB's tag_ids, or carry the KB's
    implicit tag; nothing else (not another KB's implicit tag, not an empty tag set)."""
    k = kb(tag_ids=["infra", "search"])
    assert k.matches(["search"])
    assert k.matches(["x", "infra"])
    assert k.matches([kb_tag("k1")])
    assert not k.matches([kb_tag("k2"), "other"])
    assert not k.matches([])
    assert not kb().matches(["infra"])
    assert kb().matches(["kb:k1"])


def test_stored_tags_hold_at_most_one_collection_and_never_show_it():
    """join_tags keeps one collection tag at the end and drops any the caller passed as
    tags; split_tags never returns a `collection:` tag among the visible ones."""
    stored = join_tags(["b", "a", "a", "collection:sneaky"], "reports")
    assert stored == ["a", "b", "collection:reports"]
    assert split_tags(stored) == (["a", "b"], "reports")
    assert join_tags(["a"], None) == ["a"]
    visible, collection = split_tags(["x", "collection:one", "collection:two"])
    assert visible == ["x"] and collection == "one"
    assert join_tags(visible, collection) == ["x", "collection:one"]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"chunk_size": 300}, "chunk_size"),  # above all-MiniLM-L6-v2's 254 tokens
        ({"chunk_size": 49}, "chunk_size"),
        ({"chunk_size": 100, "chunk_overlap": 100}, "chunk_overlap"),
        ({"chunk_size": 100, "chunk_overlap": -1}, "chunk_overlap"),
        ({"embedding_model": "local/unknown"}, "embedding_model"),
        ({"coalesce_neighbors": 6}, "coalesce_neighbors"),
        ({"tag_ids": ["collection:x"]}, "tag_ids"),
        ({"tag_ids": [""]}, "tag_ids"),
    ],
)
def test_each_kb_settings_rule_names_its_field(fields, field):
    """Each invalid setting — a rule of the KB model itself, or the embedding model's input
    limit — is refused with InvalidInput naming the field."""
    with pytest.raises(InvalidInput) as err:
        checked_kb({"org_id": "o", "kb_id": "k1", "name": "n", **fields})
    assert err.value.field == field
    assert field in err.value.message


def test_valid_kb_settings_pass():
    checked_kb(kb(chunk_size=254, chunk_overlap=253, coalesce_neighbors=5).model_dump())
    checked_kb(kb(chunk_size=50).model_dump())


def test_the_kb_model_holds_its_rules_wherever_it_is_built():
    """The rules are the model's validators: a KB with overlapping chunks or an unknown
    local model cannot even be constructed (ingest and embed read the same model)."""
    with pytest.raises(ValidationError, match="chunk_overlap"):
        kb(chunk_size=100, chunk_overlap=100)
    with pytest.raises(ValidationError, match="embedding_model"):
        kb(embedding_model="local/unknown")


@pytest.mark.parametrize(
    "body",
    [
        {"chunk_size": 2001},
        {"chunk_size": 10},
        {"coalesce_neighbors": 6},
        {"chunker": "semantic"},
        {"name": ""},
        {"unknown": 1},
    ],
)
def test_request_model_rejects_out_of_range_settings(body):
    with pytest.raises(ValidationError):
        KbCreate.model_validate({"name": "n", **body})


def test_default_kb_ids_are_unique_per_org():
    """The default org keeps `default` as its default KB's id; every other org gets a
    stable id of its own, so no two orgs share a collection or index entries."""
    kbs = KnowledgeBases(None, None, Settings(default_org="local"), Catalog())  # type: ignore[arg-type]
    assert kbs.default_id("local") == "default"
    a, b = kbs.default_id("org-a"), kbs.default_id("org-b")
    assert len({a, b, "default"}) == 3
    assert kbs.default_id("org-a") == a
    assert len(a) <= 64 and a.isalnum()


class _Keys:
    """The slice of a Registry[ApiKey] that KeyResolver reads, in memory; `mirrored`: with a
    live copy that every write reaches, unless its watch is broken."""

    def __init__(self, mirrored: bool = False) -> None:
        self.items: dict[str, ApiKey] = {}
        self.mirror: dict[str, ApiKey] = {}
        self.mirrored = mirrored
        self.watch_broken = False
        self.kv = SimpleNamespace(status=self._status)

    async def _status(self) -> SimpleNamespace:
        return SimpleNamespace(values=len(self.items))

    async def list(self, *, fresh: bool = False) -> list[ApiKey]:
        return list((self.mirror if self.mirrored and not fresh else self.items).values())

    async def get(self, key: str) -> ApiKey | None:
        return self.items.get(key)

    async def put(self, key: str, value: ApiKey) -> int:
        self.items[key] = value
        if not self.watch_broken:
            self.mirror[key] = value
        return len(self.items)


@pytest.mark.parametrize("mirrored", [False, True])
async def test_keys_resolve_to_their_org_and_keyless_access_ends_with_the_first_key(
    mirrored: bool,
):
    """Without keys, loopback callers are the default org and others are refused; a key
    stored by anyone (another resolver: the CLI, another replica) ends keyless access at
    once; keys resolve to their org; org ids must be key-safe."""
    keys = _Keys(mirrored)
    gateway = KeyResolver(keys, "local")  # type: ignore[arg-type]
    assert (await gateway.resolve(None, "127.0.0.1")).org_id == "local"
    with pytest.raises(Unauthorized):
        await gateway.resolve(None, "10.1.2.3")
    token = await KeyResolver(keys, "local").create("acme")  # type: ignore[arg-type]
    with pytest.raises(Unauthorized):
        await gateway.resolve(None, "127.0.0.1")
    assert (await gateway.resolve(f"Bearer {token}", "10.1.2.3")).org_id == "acme"
    assert hash_key(token) in keys.items and token not in str(keys.items)
    with pytest.raises(Unauthorized):
        await gateway.resolve("Bearer kbm_wrong", "127.0.0.1")
    with pytest.raises(Unauthorized):
        await gateway.resolve(f"Basic {token}", "127.0.0.1")
    with pytest.raises(InvalidInput):
        await gateway.create("a.b")


async def test_a_key_mirror_that_missed_a_key_is_not_trusted_beyond_a_second(
    monkeypatch: pytest.MonkeyPatch,
):
    """Keyless requests are answered from the keys' mirror, but the bucket itself is asked
    at least every second: a key the mirror never heard of (its watch broke) ends keyless
    access within that second."""
    now = [100.0]
    monkeypatch.setattr("services.gateway.auth.time.monotonic", lambda: now[0])
    keys = _Keys(mirrored=True)
    gateway = KeyResolver(keys, "local")  # type: ignore[arg-type]
    assert (await gateway.resolve(None, "127.0.0.1")).org_id == "local"
    keys.watch_broken = True
    await KeyResolver(keys, "local").create("acme")  # type: ignore[arg-type]
    now[0] += 0.5
    assert (await gateway.resolve(None, "127.0.0.1")).org_id == "local"
    now[0] += 0.6
    with pytest.raises(Unauthorized):
        await gateway.resolve(None, "127.0.0.1")


def test_size_limit_message_states_the_configured_limit():
    with pytest.raises(TooLarge, match="10 MB limit"):
        check_size(10 * 1024 * 1024 + 1, 10 * 1024 * 1024)
    with pytest.raises(TooLarge, match="100000 bytes limit"):
        check_size(100_001, 100_000)
