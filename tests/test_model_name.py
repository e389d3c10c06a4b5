"""The ResNet18 class for plain-code loading: timm's resnet18 keys, and its own name in the
refusal of a download."""

from __future__ import annotations

import pytest
import timm

from imgtrainer.errors import UserError
from imgtrainer.models import ResNet18Classifier


def test_the_plain_code_class_loads_timms_resnet18_exactly():
    model = ResNet18Classifier(num_classes=90)
    model.load_state_dict(timm.create_model("resnet18", num_classes=90).state_dict())
    assert model.fc.out_features == 90


def test_pretrained_download_is_refused_under_the_name_used():
    with pytest.raises(UserError, match=r"^ResNet18Classifier\(pretrained=True\)"):
        ResNet18Classifier(num_classes=3, pretrained=True)
