import gc

from service.app import _GC_THRESHOLDS, _settle_heap


def test_after_loading_the_heap_is_frozen_and_young_collections_are_rarer() -> None:
    """What the server does once its models are loaded: what loading made is never walked by
    the garbage collector again, and young objects are collected less often."""
    before = gc.get_threshold()
    try:
        _settle_heap()
        assert gc.get_freeze_count() > 1000  # modules, classes, loaded objects
        assert gc.get_threshold() == _GC_THRESHOLDS
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
