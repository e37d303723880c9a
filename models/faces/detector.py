"""Faces in an image: MTCNN's three stages as a model's own code over three served models.

The image pyramid, the non-maximum suppression, the crops and the mapping of boxes and
landmarks back to the caller's image are code; each network is a model of the same server,
called by name (``self.models.infer``), so every stage batches with every other request's:
``faces_pnet`` (fully convolutional, any H × W within its buckets), ``faces_rnet`` (24 × 24
crops) and ``faces_onet`` (48 × 48 crops, with five landmarks). The ``faces`` model's own
network only passes the image's size through: the work is all in the steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from preprocessing.image import ImagePipeline
from preprocessing.pipeline import Arrays, Item, Pipeline
from preprocessing.spec import ImageSpec

WINDOW = 12
"""P-Net's window: the smallest face it finds, in pixels of the level it runs on."""
STEP_ROWS = 64
"""Crops per call of R-Net or O-Net (their max_batch_size)."""


class FaceDetector(Pipeline):
    """An encoded image → ``[{"box", "score", "landmarks"}]`` in its own pixel coordinates."""

    raw_input = "image_bytes"
    json_items = False

    def __init__(
        self,
        min_face: int = 20,
        factor: float = 0.709,
        thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
        max_side: int = 640,
        max_candidates: int = 256,
    ) -> None:
        self.min_face, self.factor, self.thresholds = min_face, factor, tuple(thresholds)
        self.max_side, self.max_candidates = max_side, max_candidates
        self.decoder = ImagePipeline(ImageSpec(color="RGB"))

    def preprocess(self, item: Item, context: dict[str, Any]) -> Arrays:
        image = self.decoder.decode(item.bytes())
        width, height = image.size
        shrink = min(1.0, self.max_side / max(width, height))  # bounds the work per image
        if shrink < 1.0:
            image = image.resize(
                (max(1, round(width * shrink)), max(1, round(height * shrink))),
                Image.Resampling.BILINEAR,
            )
        context["image"], context["shrink"] = image, shrink
        return {"size": np.array([height, width], dtype=np.int32)}

    def postprocess(self, outputs: Mapping[str, np.ndarray], context: dict[str, Any]) -> Any:
        image: Image.Image = context["image"]
        boxes = self._propose(image)
        boxes = self._refine(image, boxes)
        boxes, landmarks = self._output(image, boxes)
        scale = 1.0 / context["shrink"]
        faces = []
        for box, points in zip(boxes, landmarks, strict=True):
            faces.append(
                {
                    "box": [round(float(v) * scale, 2) for v in box[:4]],
                    "score": round(float(box[4]), 5),
                    "landmarks": [
                        [round(float(x) * scale, 2), round(float(y) * scale, 2)] for x, y in points
                    ],
                }
            )
        return sorted(faces, key=lambda f: -f["score"])

    # -- the three stages --------------------------------------------------------------------

    def _propose(self, image: Image.Image) -> np.ndarray:
        """P-Net over the pyramid: candidate squares ``[n, 5]`` (x1, y1, x2, y2, score)."""
        width, height = image.size
        scale = WINDOW / self.min_face
        side = min(width, height) * scale
        found = []
        while side >= WINDOW:
            # Even sizes: faces_pnet is padded to its buckets from multiples of 2 only (export
            # measured its pooling window of 2, ceil_mode, reading the padding at odd sizes).
            level_w, level_h = _even(width * scale), _even(height * scale)
            level = _normalized(image.resize((level_w, level_h), Image.Resampling.BILINEAR))
            out = self.models.infer("faces_pnet", {"image": level[None]})
            prob, offsets = out["prob"][0, 1], out["offsets"][0]
            ys, xs = np.nonzero(prob >= self.thresholds[0])
            if len(ys):
                # back by the level's own scale on each axis (rounded up, a level is stretched)
                across, down = level_w / width, level_h / height
                boxes = np.stack(
                    [
                        np.floor((2 * xs + 1) / across),
                        np.floor((2 * ys + 1) / down),
                        np.floor((2 * xs + WINDOW) / across),
                        np.floor((2 * ys + WINDOW) / down),
                        prob[ys, xs],
                    ],
                    axis=1,
                )
                boxes = _regress(boxes, offsets[:, ys, xs].T)
                found.append(boxes[_nms(boxes, 0.5)])
            scale *= self.factor
            side *= self.factor
        if not found:
            return np.zeros((0, 5))
        boxes = np.concatenate(found)
        boxes = boxes[_nms(boxes, 0.7)][: self.max_candidates]
        return _square(boxes)

    def _refine(self, image: Image.Image, boxes: np.ndarray) -> np.ndarray:
        """R-Net on 24 × 24 crops of the candidates: the ones it keeps, moved and squared."""
        if not len(boxes):
            return boxes
        out = self._batched("faces_rnet", _crops(image, boxes, 24))
        score = out["prob"][:, 1]
        keep = score > self.thresholds[1]
        boxes = np.concatenate([boxes[keep, :4], score[keep, None]], axis=1)
        boxes = _regress(boxes, out["offsets"][keep])
        return _square(boxes[_nms(boxes, 0.7)])

    def _output(self, image: Image.Image, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """O-Net on 48 × 48 crops: final boxes and their five landmarks."""
        if not len(boxes):
            return boxes, np.zeros((0, 5, 2))
        out = self._batched("faces_onet", _crops(image, boxes, 48))
        score = out["prob"][:, 1]
        keep = score > self.thresholds[2]
        kept, marks = boxes[keep], out["landmarks"][keep]
        w, h = kept[:, 2] - kept[:, 0], kept[:, 3] - kept[:, 1]
        points = np.stack(
            [kept[:, :1] + w[:, None] * marks[:, :5], kept[:, 1:2] + h[:, None] * marks[:, 5:]],
            axis=2,
        )
        kept = np.concatenate([kept[:, :4], score[keep, None]], axis=1)
        kept = _regress(kept, out["offsets"][keep])
        chosen = _nms(kept, 0.7, smaller=True)
        return kept[chosen], points[chosen]

    def _batched(self, model: str, crops: np.ndarray) -> dict[str, np.ndarray]:
        parts = [
            self.models.infer(model, {"crops": crops[i : i + STEP_ROWS]})
            for i in range(0, len(crops), STEP_ROWS)
        ]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _even(size: float) -> int:
    """``size`` rounded up to an even number of pixels."""
    return 2 * int(np.ceil(size / 2))


def _normalized(image: Image.Image) -> np.ndarray:
    """RGB pixels → CHW float32 in about [-1, 1], as the networks were trained."""
    array = np.asarray(image, dtype=np.float32)
    return np.ascontiguousarray(((array - 127.5) * 0.0078125).transpose(2, 0, 1))


def _crops(image: Image.Image, boxes: np.ndarray, size: int) -> np.ndarray:
    """Each box's pixels (zeros beyond the image) resized to ``size`` × ``size``."""
    crops = []
    for x1, y1, x2, y2 in np.round(boxes[:, :4]).astype(int):
        region = image.crop((x1, y1, max(x2, x1 + 1), max(y2, y1 + 1)))
        crops.append(_normalized(region.resize((size, size), Image.Resampling.BILINEAR)))
    return np.stack(crops)


def _regress(boxes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Boxes moved by the network's offsets (fractions of their width and height)."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    moved = boxes.copy()
    moved[:, :4] += offsets[:, :4] * np.stack([w, h, w, h], axis=1)
    return moved


def _square(boxes: np.ndarray) -> np.ndarray:
    """Each box as the square of its longer side, about the same centre."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    side = np.maximum(w, h)
    squared = boxes.copy()
    squared[:, 0] = boxes[:, 0] + w / 2 - side / 2
    squared[:, 1] = boxes[:, 1] + h / 2 - side / 2
    squared[:, 2], squared[:, 3] = squared[:, 0] + side, squared[:, 1] + side
    return squared


def _nms(boxes: np.ndarray, threshold: float, smaller: bool = False) -> np.ndarray:
    """Indices of the boxes kept by greedy non-maximum suppression, best score first; overlap
    is intersection over union, or over the smaller box (``smaller``)."""
    if not len(boxes):
        return np.zeros(0, dtype=int)
    x1, y1, x2, y2, score = boxes.T
    area = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = np.argsort(-score, kind="stable")
    kept = []
    while len(order):
        best, rest = order[0], order[1:]
        kept.append(best)
        iw = np.maximum(0.0, np.minimum(x2[best], x2[rest]) - np.maximum(x1[best], x1[rest]) + 1)
        ih = np.maximum(0.0, np.minimum(y2[best], y2[rest]) - np.maximum(y1[best], y1[rest]) + 1)
        inter = iw * ih
        base = np.minimum(area[best], area[rest]) if smaller else area[best] + area[rest] - inter
        order = rest[inter / base <= threshold]
    return np.array(kept, dtype=int)
