"""resnet18/resnet50 for the examples when torchvision is not installed (same layer shapes as
torchvision's; no pretrained weights)."""

import torch.nn as nn


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = _shortcut(cin, cout, stride)

    def forward(self, x):
        return (self.body(x) + self.skip(x)).relu()


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = _shortcut(cin, cout, stride)

    def forward(self, x):
        return (self.body(x) + self.skip(x)).relu()


def _shortcut(cin, cout, stride):
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


def _resnet(block, layers, num_classes=1000):
    mods = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for i, n in enumerate(layers):
        width = 64 * 2**i
        for j in range(n):
            mods.append(block(cin, width, 2 if j == 0 and i > 0 else 1))
            cin = width * block.expansion
    mods += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*mods)


def resnet18(num_classes=1000):
    return _resnet(_Basic, [2, 2, 2, 2], num_classes)


def resnet50(num_classes=1000):
    return _resnet(_Bottleneck, [3, 4, 6, 3], num_classes)
