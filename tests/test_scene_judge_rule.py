"""The rule judge (jscenegen/scene/judge_rule.py): prompt_following's matching, and exact grades."""
import pytest

from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.judge_rule import requested_share

from scene_fixtures import obj, scene

CAT = load_catalogue()
QUEEN = obj("queen_bed_1", "queen_bed", 2.0, 1.5, 1.52, 2.03, 1.0)
SINGLE = obj("single_bed_1", "single_bed", 0.6, 1.5, 0.9, 1.9, 0.9)


@pytest.mark.parametrize("objects,requested,share", [
    # one queen bed fills `bed` or `queen_bed`, never both (it counted twice: 1.0)
    ([QUEEN], [("bed", 1), ("queen_bed", 1)], 0.5),
    ([QUEEN], [("queen_bed", 1), ("bed", 1)], 0.5),
    # two beds fill both, whichever order the items come in (a greedy pass in request order
    # gives the queen bed to `bed` and leaves `queen_bed` empty)
    ([QUEEN, SINGLE], [("bed", 1), ("queen_bed", 1)], 1.0),
    ([SINGLE, QUEEN], [("queen_bed", 1), ("bed", 1)], 1.0),
    ([QUEEN, SINGLE], [("bed", 2), ("queen_bed", 1)], 2 / 3),
    ([QUEEN], [("queen_bed", 3)], 1 / 3),
    ([], [("bed", 1)], 0.0),
    ([QUEEN], [], 1.0),
])
def test_each_object_fills_at_most_one_requested_item(objects, requested, share):
    req = [{"category": c, "count": n} for c, n in requested]
    assert requested_share(scene(objects), req, CAT) == pytest.approx(share)
