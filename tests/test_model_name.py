"""The ResNet18 class for plain-code loading has a dataset-neutral name; the former one still
works, with its 90-class default."""

from __future__ import annotations

import pytest
import timm

from imgtrainer.errors import UserError
from imgtrainer.models import ResNet18Animals90, ResNet18Classifier


def test_the_former_name_is_the_same_model_with_90_classes():
    old, new = ResNet18Animals90(), ResNet18Classifier(num_classes=90)
    assert isinstance(old, ResNet18Classifier)
    assert {k: v.shape for k, v in old.state_dict().items()} == {
        k: v.shape for k, v in new.state_dict().items()
    }
    new.load_state_dict(timm.create_model("resnet18", num_classes=90).state_dict())
    assert old.fc.out_features == 90


def test_pretrained_download_is_refused_under_the_name_used():
    with pytest.raises(UserError, match=r"^ResNet18Classifier\(pretrained=True\)"):
        ResNet18Classifier(num_classes=3, pretrained=True)
