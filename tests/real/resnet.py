"""A ResNet-18 in Equinox with BatchNorm state: jaxonmodels' torchvision port, and its CIFAR-10 loss.

Source: Artur-Galstyan/jaxonmodels @ 2028ad0739fb3799c57bd7f8faf2ff039cdfd3b2 ("resnet added -
with weights", 2024-05-18), `jaxonmodels/vision/resnet.py` whole (`conv3x3`, `Downsample`,
`BasicBlock`, `Bottleneck`, `ResnetLayer`, `ResNet`, `resnet18`...: `eqx.nn.BatchNorm(...,
axis_name="batch")` with `eqx.nn.State` threaded through every block, built by
`eqx.nn.make_with_state`), and the loss of `examples/train_resnet.py` at the same commit
(`named_batch_vmap(resnet)(x, state)`, i.e. `eqx.filter_vmap(in_axes=(0, None), out_axes=(0,
None), axis_name="batch")`, softmax cross-entropy on integer labels, the new state as aux).
The repository's later revisions swap `eqx.nn.BatchNorm` for their own layer package; the
popular `eqxvision` ResNet uses `equinox.experimental.BatchNorm`, which no longer exists.

Changed from the source:
- sizes only: channels 64/128/256/512 -> 8/16/32/64 (the literal widths in `ResNet`, source
  values in comments), resnet18's [2, 2, 2, 2] blocks kept; CIFAR-sized 3x32x32 images, 10
  classes, batch 8 (at 16x16 and batch 4 the BatchNorms of layer3/4 normalise over 4 values and
  float32 gradients are off by 2e-4 from float64's);
- `beartype.typing` imports taken from `typing` (beartype re-exports them; not installed
  here); `_load` (pretrained weights from S3) raises instead of importing the S3 client.
"""

import equinox as eqx
import jax
from typing import Optional, Type  # the source: from beartype.typing (a re-export)
from equinox.nn import State
from jaxtyping import Array, PRNGKeyArray


def conv3x3(
    in_channels: int,
    out_channels: int,
    stride: int = 1,
    groups: int = 1,
    *,
    key: PRNGKeyArray,
) -> eqx.nn.Conv2d:
    return eqx.nn.Conv2d(
        in_channels,
        out_channels,
        kernel_size=3,
        stride=stride,
        padding=1,
        groups=groups,
        use_bias=False,
        key=key,
    )


def conv1x1(
    in_channels: int, out_channels: int, stride: int = 1, *, key: PRNGKeyArray
) -> eqx.nn.Conv2d:
    return eqx.nn.Conv2d(
        in_channels, out_channels, kernel_size=1, stride=stride, use_bias=False, key=key
    )


class Downsample(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, *, key: PRNGKeyArray
    ) -> None:
        self.conv = conv1x1(in_channels, out_channels, stride, key=key)
        self.norm = eqx.nn.BatchNorm(out_channels, axis_name="batch")

    def __call__(self, x: Array, state: State) -> tuple[Array, State]:
        x = self.conv(x)
        x, state = self.norm(x, state)

        return x, state


class BasicBlock(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    downsample: Optional[Downsample]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int = 1,
        downsample: Optional[Downsample] = None,
        groups: int = 1,
        base_width: int = 64,
        *,
        key: PRNGKeyArray,
    ):
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock only supports groups=1 and base_width=64")
        key, conv1_key, conv2_key = jax.random.split(key, 3)
        self.conv1 = conv3x3(in_channels, out_channels, stride, key=conv1_key)
        self.bn1 = eqx.nn.BatchNorm(out_channels, axis_name="batch")
        self.conv2 = conv3x3(out_channels, out_channels, key=conv2_key)
        self.bn2 = eqx.nn.BatchNorm(out_channels, axis_name="batch")
        self.downsample = downsample

    def __call__(self, x: Array, state: State) -> tuple[Array, State]:
        identity = x

        out = self.conv1(x)
        out, state = self.bn1(out, state)
        out = jax.nn.relu(out)

        out = self.conv2(out)
        out, state = self.bn2(out, state)

        if self.downsample is not None:
            identity, state = self.downsample(x, state)

        out += identity
        out = jax.nn.relu(out)

        return out, state


class Bottleneck(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    conv3: eqx.nn.Conv2d
    bn3: eqx.nn.BatchNorm

    downsample: Optional[Downsample]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int = 1,
        downsample: Optional[Downsample] = None,
        groups: int = 1,
        base_width: int = 64,
        *,
        key: PRNGKeyArray,
    ) -> None:
        width = int(out_channels * (base_width / 64.0)) * groups
        conv1_key, conv2_key, conv3_key = jax.random.split(key, 3)
        expansion = 4
        self.conv1 = conv1x1(in_channels, width, key=conv1_key)
        self.bn1 = eqx.nn.BatchNorm(width, axis_name="batch")
        self.conv2 = conv3x3(width, width, stride, groups, key=conv2_key)
        self.bn2 = eqx.nn.BatchNorm(width, axis_name="batch")
        self.conv3 = conv1x1(width, out_channels * expansion, key=conv3_key)
        self.bn3 = eqx.nn.BatchNorm(out_channels * expansion, axis_name="batch")
        self.downsample = downsample

    def __call__(self, x: Array, state: State) -> tuple[Array, State]:
        identity = x
        x = self.conv1(x)
        x, state = self.bn1(x, state)
        x = jax.nn.relu(x)

        x = self.conv2(x)
        x, state = self.bn2(x, state)
        x = jax.nn.relu(x)

        x = self.conv3(x)
        x, state = self.bn3(x, state)

        if self.downsample is not None:
            identity, state = self.downsample(identity, state)

        x += identity
        x = jax.nn.relu(x)

        return x, state


class ResnetLayer(eqx.Module):
    layers: list[BasicBlock | Bottleneck]

    def __init__(self, layers: list[BasicBlock | Bottleneck]) -> None:
        self.layers = layers

    def __call__(self, x: Array, state: State) -> tuple[Array, State]:
        for l in self.layers:
            x, state = l(x, state)
        return x, state


class ResNet(eqx.Module):
    in_channels: int = eqx.field(static=True)

    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    maxpool: eqx.nn.MaxPool2d

    layer1: ResnetLayer
    layer2: ResnetLayer
    layer3: ResnetLayer
    layer4: ResnetLayer

    avgpool: eqx.nn.AdaptiveAvgPool2d
    fc: eqx.nn.Linear

    def __init__(
        self,
        block: Type[BasicBlock | Bottleneck],
        layers: list[int],
        image_channels: int = 3,
        num_classes: int = 1000,
        groups: int = 1,
        width_per_group: int = 64,
        *,
        key: PRNGKeyArray,
    ) -> None:
        self.in_channels = 8  # 64
        key, conv_key = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(
            image_channels,
            self.in_channels,
            kernel_size=7,
            stride=2,
            padding=3,
            use_bias=False,
            key=conv_key,
        )
        self.bn1 = eqx.nn.BatchNorm(self.in_channels, axis_name="batch")
        self.maxpool = eqx.nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        key, *layer_keys = jax.random.split(key, len(layers) + 1)
        self.layer1 = self._make_layer(
            block,
            out_channels=8,  # 64
            num_residual_blocks=layers[0],
            stride=1,
            groups=groups,
            base_width=width_per_group,
            key=layer_keys[0],
        )
        self.layer2 = self._make_layer(
            block,
            out_channels=16,  # 128
            num_residual_blocks=layers[1],
            stride=2,
            groups=groups,
            base_width=width_per_group,
            key=layer_keys[1],
        )

        self.layer3 = self._make_layer(
            block,
            out_channels=32,  # 256
            num_residual_blocks=layers[2],
            stride=2,
            groups=groups,
            base_width=width_per_group,
            key=layer_keys[2],
        )

        self.layer4 = self._make_layer(
            block,
            out_channels=64,  # 512
            num_residual_blocks=layers[3],
            stride=2,
            groups=groups,
            base_width=width_per_group,
            key=layer_keys[3],
        )

        self.avgpool = eqx.nn.AdaptiveAvgPool2d((1, 1))
        key, fc_key = jax.random.split(key)
        self.fc = eqx.nn.Linear(64 * _get_expansion(block), num_classes, key=fc_key)  # 512

    def __call__(self, x: Array, state: State) -> tuple[Array, State]:
        x = self.conv1(x)
        x, state = self.bn1(x, state)
        x = jax.nn.relu(x)
        x = self.maxpool(x)

        x, state = self.layer1(x, state)
        x, state = self.layer2(x, state)
        x, state = self.layer3(x, state)
        x, state = self.layer4(x, state)
        x = self.avgpool(x)
        x = x.reshape(-1)
        x = self.fc(x)
        return x, state

    def _make_layer(
        self,
        block: Type[BasicBlock | Bottleneck],
        out_channels: int,
        num_residual_blocks: int,
        stride: int,
        groups: int,
        base_width: int,
        *,
        key: PRNGKeyArray,
    ):
        downsample = None
        expansion = _get_expansion(block)
        key, downsample_key = jax.random.split(key)
        if stride != 1 or self.in_channels != out_channels * expansion:
            downsample = Downsample(
                self.in_channels, out_channels * expansion, stride, key=downsample_key
            )
        layers = []
        key, *layer_keys = jax.random.split(key, num_residual_blocks + 1)

        layers.append(
            block(
                self.in_channels,
                out_channels,
                stride,
                downsample,
                groups=groups,
                base_width=base_width,
                key=layer_keys[0],
            )
        )
        self.in_channels = out_channels * expansion
        for i in range(num_residual_blocks - 1):
            layers.append(
                block(
                    self.in_channels,
                    out_channels,
                    groups=groups,
                    base_width=base_width,
                    key=layer_keys[i + 1],
                )
            )
        return ResnetLayer(layers)


def _get_expansion(block_type: Type[Bottleneck | BasicBlock]) -> int:
    if block_type == Bottleneck:
        return 4
    else:
        return 1


def resnet18(
    image_channels: int = 3,
    num_classes: int = 1000,
    with_weights: bool = False,
    target_path_for_weights: Optional[str] = None,
    *,
    key: PRNGKeyArray,
    **kwargs,
) -> tuple[ResNet, eqx.nn.State]:
    layers = [2, 2, 2, 2]
    model, state = eqx.nn.make_with_state(ResNet)(
        BasicBlock, layers, image_channels, num_classes, **kwargs, key=key
    )
    if with_weights:
        object_key = "resnet18.eqx"
        model, state = _load(object_key, target_path_for_weights, model, state)
    return model, state


def resnet34(
    image_channels: int = 3,
    num_classes: int = 1000,
    with_weights: bool = False,
    target_path_for_weights: Optional[str] = None,
    *,
    key: PRNGKeyArray,
    **kwargs,
):
    layers = [3, 4, 6, 3]
    model, state = eqx.nn.make_with_state(ResNet)(
        BasicBlock, layers, image_channels, num_classes, **kwargs, key=key
    )

    if with_weights:
        object_key = "resnet34.eqx"
        model, state = _load(object_key, target_path_for_weights, model, state)
    return model, state


def resnet50(
    image_channels: int = 3,
    num_classes: int = 1000,
    with_weights: bool = False,
    target_path_for_weights: Optional[str] = None,
    *,
    key: PRNGKeyArray,
    **kwargs,
):
    layers = [3, 4, 6, 4]
    model, state = eqx.nn.make_with_state(ResNet)(
        Bottleneck, layers, image_channels, num_classes, **kwargs, key=key
    )
    if with_weights:
        object_key = "resnet50.eqx"
        model, state = _load(object_key, target_path_for_weights, model, state)
    return model, state


def resnet101(
    image_channels: int = 3,
    num_classes: int = 1000,
    with_weights: bool = False,
    target_path_for_weights: Optional[str] = None,
    *,
    key: PRNGKeyArray,
    **kwargs,
):
    layers = [3, 4, 23, 3]
    model, state = eqx.nn.make_with_state(ResNet)(
        Bottleneck, layers, image_channels, num_classes, **kwargs, key=key
    )

    if with_weights:
        object_key = "resnet101.eqx"
        model, state = _load(object_key, target_path_for_weights, model, state)
    return model, state


def resnet152(
    image_channels: int = 3,
    num_classes: int = 1000,
    with_weights: bool = False,
    target_path_for_weights: Optional[str] = None,
    *,
    key: PRNGKeyArray,
    **kwargs,
):
    layers = [3, 8, 36, 3]
    model, state = eqx.nn.make_with_state(ResNet)(
        Bottleneck, layers, image_channels, num_classes, **kwargs, key=key
    )

    if with_weights:
        object_key = "resnet152.eqx"
        model, state = _load(object_key, target_path_for_weights, model, state)
    return model, state


def _load(object_key, target_path_for_weights, model, state):
    # the source downloads pretrained weights from S3 here (jaxonmodels.utils.boto_client)
    raise NotImplementedError("pretrained weights are not part of the test corpus")


# ---- from examples/train_resnet.py @ 2028ad0 (the loss) ----
import functools as ft  # noqa: E402

import optax  # noqa: E402

named_batch_vmap = ft.partial(
    eqx.filter_vmap, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
)


def loss_fn(
    resnet: ResNet, state: eqx.nn.State, x: Array, y: Array
) -> tuple[Array, eqx.nn.State]:
    out, state = named_batch_vmap(resnet)(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), state


# ---- the corpus interface ----
NAME = "resnet"
HAS_AUX = True  # `loss` returns `(loss, new_state)`: the step threads the BatchNorm state
BATCH = 8


def make(key):
    """ResNet-18 (tiny widths) and a batch `(x, y, state)`: images, labels, the BatchNorm state."""
    model_key, x_key, y_key = jax.random.split(key, 3)
    model, state = resnet18(num_classes=10, key=model_key)
    x = jax.random.normal(x_key, (BATCH, 3, 32, 32))
    y = jax.random.randint(y_key, (BATCH,), 0, 10)
    return model, (x, y, state)


def loss(model, batch):
    """The example's `loss_fn(resnet, state, x, y)`: `(mean cross-entropy, new state)`."""
    x, y, state = batch
    return loss_fn(model, state, x, y)
